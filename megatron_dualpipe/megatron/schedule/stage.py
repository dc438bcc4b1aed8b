"""A Megatron model chunk seen by the runtime executor as a one-tensor stage module.

The executor calls ``stage(x)`` for each forward; here that becomes Megatron's own
``forward_step`` (``set_input_tensor``, the user's ``forward_step_func``, loss scaling by
micro-batches or tokens, MoE auxiliary-loss scale, timers, ``forward_data_store``), so the
forward_step_func contract is exactly Megatron's.

With ``overlap_moe_expert_parallel_comm`` the stage is a planned stage of the runtime
(:class:`~megatron_dualpipe.runtime.PlannedStage`): every training forward goes through
the GPTModel's schedule plan (:mod:`.schedule_plan`), its backward too, and an FB pair
runs the two plans interleaved, so one micro-batch's all-to-all hides behind the other's
compute. Evaluation (forward only) runs plain forwards.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.pipeline_parallel.schedules import forward_step, set_current_microbatch
from torch import nn

from ..model.placement import ChunkRole
from .schedule_plan import PlanHandle, run_plans, start_forward

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
    #: Where the step's token count lives: the model's device (NCCL reduces device tensors).
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    forward_data_store: list[Any] = field(default_factory=list)
    total_num_tokens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.total_num_tokens is None:
            self.total_num_tokens = torch.zeros((), dtype=torch.int, device=self.device)


class MegatronStage(nn.Module):
    """One local model chunk as a stage: ``forward(x)`` returns the chunk's output, or,
    on the chunk that ends the pipeline, its loss (already divided as Megatron divides it).

    Where data enters, ``x`` is a placeholder: the chunk reads its micro-batch through the
    user's ``forward_step_func`` from ``data``, an iterator over exactly the micro-batches
    this chunk processes, in order.

    The chunk is held through a weak reference (the stage is cached beside the model, and
    must not keep a dropped model alive); it is not a submodule of the stage. With
    ``overlap`` the stage plans its training passes (see the module docstring).
    """

    def __init__(self, model: nn.Module, role: ChunkRole, *, overlap: bool = False):
        super().__init__()
        self._model = weakref.ref(model)
        self.role = role
        self.overlap = overlap
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

    def _next_forward(self) -> tuple[StepInputs, bool, int]:
        """This step's inputs, whether the coming forward is Megatron's first, and its index
        among this chunk's forwards (the chunk's own micro-batch index, which Megatron's
        ``set_current_microbatch`` gives the layers: a TE-graphed layer replays the graph of
        that index, as under Megatron's interleaved schedule)."""
        step = self.step
        if step is None:
            raise RuntimeError("MegatronStage.forward called outside a forward-backward step")
        index = self._forwards
        self._forwards += 1
        return step, _first_microbatch(step, index == 0), index

    def _count_tokens(self, num_tokens: torch.Tensor) -> None:
        if self.role.post_process:
            # On the loss's device, as Megatron's schedules count: no host sync per micro-batch.
            self.step.total_num_tokens += num_tokens.to(self.step.total_num_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step, is_first, index = self._next_forward()
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
            is_first_microbatch=is_first,
            current_microbatch=index,
            is_last_stage=self.role.post_process,
        )
        self._count_tokens(num_tokens)
        return output

    # -- the runtime's PlannedStage -------------------------------------------------------
    def plans(self) -> bool:
        """Training forwards go through the schedule plan when overlap is on."""
        return self.overlap and self.step is not None and not self.step.forward_only

    def _start(self, x: torch.Tensor) -> Any:
        step, is_first, index = self._next_forward()
        set_current_microbatch(self.model, index)
        return start_forward(
            self.model,
            None if self.role.pre_process else x,
            self.data,
            forward_step_func=step.forward_step_func,
            config=step.config,
            is_first_microbatch=is_first,
            loss_stage=self.role.post_process,
            num_microbatches=step.num_microbatches,
            forward_data_store=step.forward_data_store,
            collect_non_loss_data=step.collect_non_loss_data,
            cp_group_size=step.cp_group_size,
        )

    def _finished(self, result: tuple[torch.Tensor, torch.Tensor, PlanHandle]):
        output, num_tokens, handle = result
        self._count_tokens(num_tokens)
        return output, handle

    def forward_planned(self, x: torch.Tensor) -> tuple[torch.Tensor, PlanHandle]:
        """Forward ``x`` through the chunk's schedule plan."""
        return self._finished(run_plans(self._start(x), None))

    def backward_planned(
        self,
        handle: PlanHandle,
        roots: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None,
    ) -> None:
        """Backward a planned micro-batch through its plan."""
        run_plans(None, _backward_of(handle, roots, grads))

    def forward_backward_planned(
        self,
        args: tuple[torch.Tensor, ...],
        backward_stage: MegatronStage,
        handle: PlanHandle,
        roots: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, PlanHandle]:
        """This chunk's forward of ``args`` (one tensor) and the backward of ``handle`` (any
        chunk of this rank), interleaved layer by layer by Megatron's plan."""
        (x,) = args
        return self._finished(run_plans(self._start(x), _backward_of(handle, roots, grads)))


def _backward_of(
    handle: PlanHandle, roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None
) -> tuple[PlanHandle, torch.Tensor, torch.Tensor | None]:
    """A chunk has one output: its root (output or scaled loss) and its gradient."""
    (root,) = roots
    return handle, root, None if grads is None else grads[0]


def _first_microbatch(step: StepInputs, is_first: bool) -> bool:
    """Megatron's rule: in a validation step only ``first_val_step`` counts as first."""
    if step.first_val_step is not None and step.forward_only:
        return step.first_val_step and is_first
    return is_first
