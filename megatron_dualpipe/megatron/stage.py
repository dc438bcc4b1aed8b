"""A Megatron model chunk seen by the runtime executor as a one-tensor stage module.

The executor calls ``stage(x)`` for each forward; here that becomes Megatron's own
``forward_step`` (``set_input_tensor``, the user's ``forward_step_func``, loss scaling by
micro-batches or tokens, MoE auxiliary-loss scale, timers, ``forward_data_store``), so the
forward_step_func contract is exactly Megatron's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.pipeline_parallel.schedules import forward_step
from torch import nn

from .placement import ChunkRole

__all__ = ["MegatronStage", "StepInputs"]


@dataclass
class StepInputs:
    """What every stage of one rank shares during one forward-backward call."""

    forward_step_func: Callable[..., Any]
    config: Any
    num_microbatches: int
    collect_non_loss_data: bool
    forward_only: bool
    first_val_step: bool | None
    cp_group_size: int
    forward_data_store: list[Any] = field(default_factory=list)
    total_num_tokens: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int))


class MegatronStage(nn.Module):
    """One local model chunk as a stage: ``forward(x)`` returns the chunk's output, or,
    on the chunk that ends the pipeline, its loss (already divided as Megatron divides it).

    Where data enters, ``x`` is a placeholder: the chunk reads its micro-batch through the
    user's ``forward_step_func`` from ``data``, an iterator over exactly the micro-batches
    this chunk processes, in order.

    The chunk is held through a weak reference (the stage is cached beside the model, and
    must not keep a dropped model alive); it is not a submodule of the stage.
    """

    def __init__(self, model: nn.Module, role: ChunkRole):
        super().__init__()
        self._model = weakref.ref(model)
        self.role = role
        self.step: StepInputs | None = None
        self.data: Iterator[Any] | None = None
        self._forwards = 0

    @property
    def model(self) -> nn.Module:
        """The model chunk this stage runs."""
        model = self._model()
        if model is None:
            raise RuntimeError(f"the model chunk of stage {self.role.stage} no longer exists")
        return model

    def begin_step(self, step: StepInputs, data: Iterator[Any] | None) -> None:
        self.step, self.data, self._forwards = step, data, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.step
        if step is None:
            raise RuntimeError("MegatronStage.forward called outside a forward-backward step")
        is_first = self._forwards == 0
        self._forwards += 1
        output, num_tokens = forward_step(
            step.forward_step_func,
            self.data,
            self.model,
            step.num_microbatches,
            None if self.role.pre_process else x,
            step.forward_data_store,
            step.config,
            step.cp_group_size,
            collect_non_loss_data=step.collect_non_loss_data,
            is_first_microbatch=_first_microbatch(step, is_first),
            is_last_stage=self.role.post_process,
        )
        if self.role.post_process:
            step.total_num_tokens += num_tokens.to(step.total_num_tokens.dtype).cpu()
        return output


def _first_microbatch(step: StepInputs, is_first: bool) -> bool:
    """Megatron's rule: in a validation step only ``first_val_step`` counts as first."""
    if step.first_val_step is not None and step.forward_only:
        return step.first_val_step and is_first
    return is_first
