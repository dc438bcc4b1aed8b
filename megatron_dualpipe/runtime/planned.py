"""Stages that run their own forward and backward, so that the two halves of an FB action
can be interleaved (one micro-batch's communication hidden behind the other's compute).

A plain stage module is called as ``module(x)`` and its backward is autograd's from the
output. A :class:`PlannedStage` instead runs each forward through a plan of its own and
keeps a handle for the backward; a micro-batch forwarded that way is also backwarded by
the stage. When both halves of an FB action belong to planned stages, the executor hands
the pair to the forward half's stage, which interleaves them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["PlannedStage"]


@runtime_checkable
class PlannedStage(Protocol):
    """The contract of a stage that plans its own passes (see the module docstring)."""

    def plans(self) -> bool:
        """Whether this step's forwards go through the plan (else plain ``module(x)``)."""
        ...

    def forward_planned(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Forward ``x``; returns the output (the loss where the pipeline ends) and the
        handle its backward needs."""
        ...

    def backward_planned(self, handle: Any, root: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Backward the micro-batch of ``handle``: from ``root`` (what the executor made of
        the output: the loss, scaled, where the pipeline ends) with ``grad``, the gradient of
        the output (None at a loss). The gradient of the input lands in its ``.grad``; weight
        gradients are accumulated (or deferred) as in a plain backward."""
        ...

    def forward_backward_planned(
        self,
        x: torch.Tensor,
        backward_stage: PlannedStage,
        handle: Any,
        root: torch.Tensor,
        grad: torch.Tensor | None,
    ) -> tuple[torch.Tensor, Any]:
        """``forward_planned(x)`` on this stage and ``backward_stage.backward_planned(handle,
        root, grad)`` interleaved; returns what ``forward_planned`` returns."""
        ...
