"""Stages that run their own forward and backward, so that the two halves of an FB action
can be interleaved (one micro-batch's communication hidden behind the other's compute).

A plain stage module is called as ``module(x)`` and its backward is autograd's from the
output. A :class:`PlannedStage` instead runs each forward through a plan of its own and
keeps a handle for the backward; a micro-batch forwarded that way is also backwarded by
the stage. When both halves of an FB action belong to planned stages, the executor hands
the pair to the forward half's stage, which interleaves them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["PlannedStage"]


@runtime_checkable
class PlannedStage(Protocol):
    """The contract of a stage that plans its own passes (see the module docstring)."""

    def plans(self) -> bool:
        """Whether this step's forwards go through the plan (else plain ``module(x)``)."""
        ...

    def forward_planned(self, *args: torch.Tensor) -> tuple[Any, Any]:
        """Forward ``args`` (as ``module(*args)`` would); returns the output (the loss where
        the pipeline ends) and the handle its backward needs."""
        ...

    def backward_planned(
        self,
        handle: Any,
        roots: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None,
    ) -> None:
        """Backward the micro-batch of ``handle``: from ``roots`` (what the executor made of
        the output: the loss, scaled, where the pipeline ends; else the output elements that
        require grad) with ``grads`` (None at a loss). The gradients of the inputs land in
        their ``.grad``; weight gradients are accumulated (or deferred) as in a plain
        backward."""
        ...

    def forward_backward_planned(
        self,
        args: tuple[torch.Tensor, ...],
        backward_stage: PlannedStage,
        handle: Any,
        roots: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None,
    ) -> tuple[Any, Any]:
        """``forward_planned(*args)`` on this stage and ``backward_stage.backward_planned(
        handle, roots, grads)`` interleaved; returns what ``forward_planned`` returns."""
        ...
