"""Each model chunk's layers are told their chunk's own micro-batch index before every
forward (Megatron's ``set_current_microbatch``, which a TE-graphed layer reads to pick the
graph it replays, as Megatron's interleaved schedule passes ``current_microbatch``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dualpipe.megatron.model.placement import ChunkRole
from megatron_dualpipe.megatron.schedule.stage import MegatronStage, StepInputs

pytestmark = pytest.mark.megatron


class _Chunk(torch.nn.Module):
    """A model chunk with Megatron's ``decoder.layers``, recording what each forward saw."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = SimpleNamespace(layers=[SimpleNamespace(), SimpleNamespace()])
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.seen: list[list[int]] = []

    def set_input_tensor(self, tensor: Any) -> None:
        self.input = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self) -> torch.Tensor:
        self.seen.append([layer.current_microbatch for layer in self.decoder.layers])
        return self.input * self.weight


def _step_func(data: Any, model: _Chunk) -> tuple[torch.Tensor, Any]:
    return model(), None


def test_every_forward_names_its_chunks_own_microbatch() -> None:
    config = TransformerConfig(num_layers=2, hidden_size=4, num_attention_heads=1)
    step = StepInputs(_step_func, config, 4, False, False, None, 1)
    chunks = [_Chunk(), _Chunk()]
    stages = [
        MegatronStage(chunk, ChunkRole(c, 1 + c, 1 + c, 0, 2, False, False))
        for c, chunk in enumerate(chunks)
    ]
    for stage in stages:
        stage.begin_step(step, None)
    x = torch.ones(2)
    # Chunk 0 runs three forwards, chunk 1 one, interleaved as a schedule would.
    for stage in (stages[0], stages[0], stages[1], stages[0]):
        stage(x)
    assert chunks[0].seen == [[0, 0], [1, 1], [2, 2]]
    assert chunks[1].seen == [[0, 0]]
    for stage in stages:  # a new step counts from 0 again
        stage.begin_step(step, None)
    stages[1](x)
    assert chunks[1].seen == [[0, 0], [0, 0]]
