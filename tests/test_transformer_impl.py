"""``transformer_impl`` (Megatron-LM's ``--transformer-impl``): which layer spec each choice
builds through the placement hook's ``gpt_chunk_specs``, and an unknown one refused.

No TE here: Megatron's spec builders are recorded, not run, for ``transformer_engine``.
"""

from __future__ import annotations

from typing import Any

import pytest
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_dualpipe.megatron.grads.deferral import DeferrableColumnParallelLinear
from megatron_dualpipe.megatron.model import layer_specs
from megatron_dualpipe.megatron.model.layer_specs import gpt_chunk_specs
from tests import tiny_models as tm

pytestmark = pytest.mark.megatron


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
