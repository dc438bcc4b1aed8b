"""``transformer_impl`` (Megatron-LM's ``--transformer-impl``) in ``train``: which layer spec
each choice builds, the TransformerConfig it builds with, the default where CUDA and
Transformer Engine are missing, and the one-sentence refusal of Transformer Engine there.

No TE here: Megatron's spec builders are recorded, not run, for ``transformer_engine``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_dualpipe.megatron.grads.deferral import DeferrableColumnParallelLinear
from megatron_dualpipe.megatron.model import layer_specs
from megatron_dualpipe.megatron.model.layer_specs import gpt_chunk_specs
from megatron_dualpipe.megatron.training import ConfigError, train
from megatron_dualpipe.megatron.training.config import load_config
from megatron_dualpipe.megatron.training.model import transformer_config, transformer_impl
from tests import tiny_models as tm

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU defaults and refusal"),
]

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class _Recorded:
    """Megatron's spec builders, recorded: each returns one layer spec (a bare
    ``ColumnParallelLinear``) and notes its ``use_transformer_engine``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def block(self, config: Any, use_transformer_engine: bool, **kwargs: Any) -> Any:
        self.calls.append(("block", use_transformer_engine))
        return TransformerBlockSubmodules(layer_specs=[ModuleSpec(module=ColumnParallelLinear)])

    def layers(self, config: Any, use_transformer_engine: bool, **kwargs: Any) -> list[Any]:
        self.calls.append(("layers", use_transformer_engine))
        return [ModuleSpec(module=ColumnParallelLinear)]

    def mtp(self, config: Any, spec: Any, use_transformer_engine: bool, **kwargs: Any) -> Any:
        self.calls.append(("mtp", use_transformer_engine))
        return spec


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> _Recorded:
    found = _Recorded()
    monkeypatch.setattr(layer_specs, "get_gpt_decoder_block_spec", found.block)
    monkeypatch.setattr(layer_specs, "get_gpt_decoder_layer_specs", found.layers)
    monkeypatch.setattr(layer_specs, "get_gpt_mtp_block_spec", found.mtp)
    return found


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_the_spec_each_transformer_impl_builds(recorded: _Recorded, impl: str) -> None:
    config = tm.tiny_gpt_config(num_layers=2, mtp_num_layers=1)
    block, mtp = gpt_chunk_specs(config, transformer_impl=impl, deferrable=True)
    te = impl == "transformer_engine"
    assert recorded.calls == [("block", te), ("layers", te), ("mtp", te)]
    # TE layers defer through delay_wgrad_compute: Megatron's spec as given; the local
    # spec's linears are the deferrable classes.
    expected = ColumnParallelLinear if te else DeferrableColumnParallelLinear
    assert block.layer_specs[0].module is expected and mtp.module is expected


def test_an_unknown_transformer_impl_is_refused() -> None:
    with pytest.raises(ValueError, match="is not one of transformer_engine, local"):
        gpt_chunk_specs(tm.tiny_gpt_config(num_layers=2), transformer_impl="inference")


def test_default_is_local_without_cuda_and_the_config_keeps_fusions_off() -> None:
    cfg = load_config(CONFIGS / "tiny_moe_cpu.yaml")
    assert cfg.transformer_impl is None and transformer_impl(cfg) == "local"
    config = transformer_config(cfg, on_gpu=False)
    fusions = (
        config.bias_activation_fusion,
        config.bias_dropout_fusion,
        config.masked_softmax_fusion,
        config.apply_rope_fusion,
        config.gradient_accumulation_fusion,
        config.moe_grouped_gemm,
        config.delay_wgrad_compute,
    )
    assert fusions == (False,) * 7


@pytest.mark.parametrize(
    ("schedule", "deferred"), [("dualpipev", True), ("zb1p", True), ("1f1b", False)]
)
def test_transformer_engine_config_is_megatron_lms_default(schedule: str, deferred: bool) -> None:
    """Built here without TE (nothing of TE runs while building the config): Megatron-LM's
    default fusions, grouped GEMM experts, and delay_wgrad_compute under a schedule that
    splits the backward; gradient_accumulation_fusion only with APEX's kernel (absent)."""
    overrides = ["transformer_impl=transformer_engine", "swiglu=true"]
    overrides += [f"pipeline_schedule={schedule}"]
    cfg = load_config(CONFIGS / "tiny_moe_cpu.yaml", overrides)
    config = transformer_config(cfg, on_gpu=False)
    assert config.bias_activation_fusion and config.bias_dropout_fusion
    assert config.masked_softmax_fusion and config.moe_grouped_gemm
    assert not config.apply_rope_fusion  # learned absolute positions: no RoPE to fuse
    assert not config.gradient_accumulation_fusion
    assert config.delay_wgrad_compute is deferred


def test_transformer_engine_without_cuda_is_one_sentence_before_any_work() -> None:
    cfg = load_config(CONFIGS / "tiny_gpt_cpu.yaml", ["transformer_impl=transformer_engine"])
    with pytest.raises(ConfigError) as err:
        train(cfg, source="tiny_gpt_cpu.yaml")
    message = str(err.value)
    assert message.startswith("tiny_gpt_cpu.yaml: transformer_impl: transformer_engine needs")
    assert "no CUDA device" in message and "transformer_impl: local" in message
    assert "\n" not in message


def test_fp8_on_local_layers_is_one_sentence_before_any_work() -> None:
    cfg = load_config(CONFIGS / "tiny_gpt_cpu.yaml", ["fp8=e4m3", "fp8_recipe=blockwise"])
    assert cfg.fp8 == "e4m3" and cfg.fp8_recipe == "blockwise"
    with pytest.raises(ConfigError) as err:
        train(cfg, source="tiny_gpt_cpu.yaml")
    message = str(err.value)
    assert message.startswith("tiny_gpt_cpu.yaml: fp8: FP8 training runs through Transformer")
    assert "\n" not in message


MOE_ACT = ["recompute_granularity=selective", "recompute_modules=moe_act"]


def test_moe_act_recomputation_builds_with_te_grouped_gemm_experts() -> None:
    """Megatron-Core takes ``moe_act`` only with grouped-GEMM experts, which the TE path
    builds (Megatron-Core's own ValueError otherwise, checked on the local config)."""
    te = load_config(
        CONFIGS / "tiny_moe_cpu.yaml", ["transformer_impl=transformer_engine", *MOE_ACT]
    )
    config = transformer_config(te, on_gpu=False)
    assert config.moe_grouped_gemm and config.recompute_modules == ["moe_act"]
    local = load_config(CONFIGS / "tiny_moe_cpu.yaml", ["transformer_impl=local", *MOE_ACT])
    with pytest.raises(ValueError, match="moe_act in recompute_modules is only supported"):
        transformer_config(local, on_gpu=False)


def test_moe_act_on_local_experts_is_one_sentence_before_any_work() -> None:
    cfg = load_config(CONFIGS / "tiny_moe_cpu.yaml", MOE_ACT)
    assert transformer_impl(cfg) == "local"
    with pytest.raises(ConfigError) as err:
        train(cfg, source="tiny_moe_cpu.yaml")
    message = str(err.value)
    assert message.startswith("tiny_moe_cpu.yaml: recompute_modules: moe_act recomputes the")
    assert "transformer_impl: transformer_engine" in message and "\n" not in message
