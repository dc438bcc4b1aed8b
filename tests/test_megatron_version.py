"""The code written for megatron-core 0.16.1 (the CPU compatibility layer and the deferrable
linear layers) accepts that release and refuses any other in one sentence, before it
changes anything."""

from __future__ import annotations

from typing import Any

import megatron.core
import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_dualpipe.errors import DualPipeError
from megatron_dualpipe.megatron import tiny_models as tm
from megatron_dualpipe.megatron.cpu_compat import apply_cpu_compat, cpu_compat_applied
from megatron_dualpipe.megatron.deferral import (
    DeferrableColumnParallelLinear,
    WeightGradDeferralError,
    deferrable_layer_spec,
    enable_weight_grad_deferral,
)
from megatron_dualpipe.megatron.version import (
    PINNED_MEGATRON_CORE,
    MegatronVersionError,
    installed_megatron_core,
)
from tests.multiproc import run_workers

pytestmark = pytest.mark.megatron

OTHER = "0.17.0"
CPU_COMPAT_REFUSAL = (
    "the CPU compatibility layer (megatron_dualpipe.megatron.cpu_compat) is written for "
    "megatron-core 0.16.1 but megatron-core 0.17.0 is installed: pip install "
    "'megatron-core==0.16.1' or run on a GPU, where the layer is not needed"
)
DEFERRAL_REFUSAL = (
    "weight-gradient deferral (megatron_dualpipe.megatron.deferral, which reproduces "
    "Megatron's linear_with_grad_accumulation_and_async_allreduce) is written for "
    "megatron-core 0.16.1 but megatron-core 0.17.0 is installed: pip install "
    "'megatron-core==0.16.1' or use a schedule that does not split the backward "
    "(1f1b, interleaved-1f1b)"
)
on_cpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="apply_cpu_compat is a no-op with CUDA"
)


@pytest.fixture
def other_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(megatron.core, "__version__", OTHER)


def test_the_pinned_release_is_installed() -> None:
    assert PINNED_MEGATRON_CORE == "0.16.1"
    assert installed_megatron_core() == megatron.core.__version__ == PINNED_MEGATRON_CORE


@on_cpu
def test_cpu_compat_accepts_the_pinned_release() -> None:
    apply_cpu_compat()
    assert cpu_compat_applied()


@on_cpu
def test_cpu_compat_refuses_another_release(other_release: None) -> None:
    with pytest.raises(MegatronVersionError) as caught:
        apply_cpu_compat()
    assert str(caught.value) == CPU_COMPAT_REFUSAL
    assert isinstance(caught.value, DualPipeError)


def test_deferrable_spec_accepts_the_pinned_release() -> None:
    spec = repr(deferrable_layer_spec(get_gpt_layer_local_spec()))
    assert "DeferrableColumnParallelLinear" in spec
    assert "DeferrableRowParallelLinear" in spec


def test_deferral_refuses_another_release(other_release: None) -> None:
    with pytest.raises(WeightGradDeferralError) as caught:
        deferrable_layer_spec(get_gpt_layer_local_spec())
    assert str(caught.value) == DEFERRAL_REFUSAL
    with pytest.raises(WeightGradDeferralError, match="megatron-core 0.17.0 is installed"):
        enable_weight_grad_deferral(torch.nn.Linear(2, 2))


def _deferral_on_release(rank: int, world_size: int, release: str) -> dict[str, Any]:
    """Build a tiny GPT (local spec), then, with megatron-core reporting ``release``, try to
    make it deferrable and to build a deferrable layer; report what happened."""
    parallel_state.initialize_model_parallel(distributed_timeout_minutes=0.1)
    try:
        model = tm.build_reference_gpt(tm.tiny_gpt_config(num_layers=1))
        megatron.core.__version__ = release  # a forked worker: nothing outlives it
        errors = []
        try:
            converted = enable_weight_grad_deferral(model)
        except WeightGradDeferralError as error:
            converted, errors = None, [str(error)]
        try:
            DeferrableColumnParallelLinear(
                4, 4, config=model.config, init_method=torch.nn.init.zeros_, bias=False
            )
        except WeightGradDeferralError as error:
            errors.append(str(error))
        plain = sum(type(m) in (ColumnParallelLinear, RowParallelLinear) for m in model.modules())
        return {"converted": converted, "errors": errors, "plain_layers_left": plain}
    finally:
        parallel_state.destroy_model_parallel()


@on_cpu
@pytest.mark.multiproc
def test_deferral_refuses_another_release_before_converting_a_layer() -> None:
    apply_cpu_compat()  # before forking: the worker inherits the patches
    pinned, other = (
        run_workers(_deferral_on_release, 1, args=(release,), timeout_s=60.0)[0]
        for release in (PINNED_MEGATRON_CORE, OTHER)
    )
    # qkv, proj, fc1, fc2 and the output layer.
    assert pinned == {"converted": 5, "errors": [], "plain_layers_left": 0}
    assert other == {"converted": None, "errors": [DEFERRAL_REFUSAL] * 2, "plain_layers_left": 5}
