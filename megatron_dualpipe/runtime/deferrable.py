"""Layers whose weight gradient (dW) can be deferred to a W action.

:class:`DeferrableLayer` is the protocol a layer follows to join the dX/dW split: its
backward computes dX at once and, while the store its forward saw captures, hands the
weight-gradient work to ``store.defer(work)``, which accumulates into ``.grad`` as autograd
would. :class:`DeferrableLinear` does this for ``torch.nn.Linear``. The protocol step by
step, and its one caveat: docs/runtime.md, "Compute".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from .weight_grad_store import WeightGradStore, accumulate_grad, active_store, defers

__all__ = ["DeferrableLayer", "DeferrableLinear", "make_deferrable"]


@runtime_checkable
class DeferrableLayer(Protocol):
    """A layer that hands its weight-gradient work to the active store (see module doc)."""

    def deferred_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters whose gradient waits for the W action when deferral is on."""
        ...


def _weight_grad(grad_output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """dW of ``y = x W^T``: ``grad_output^T x`` over all leading dimensions."""
    return (
        grad_output.reshape(-1, grad_output.shape[-1]).t().mm(inputs.reshape(-1, inputs.shape[-1]))
    )


class _LinearFunction(torch.autograd.Function):
    """``F.linear`` whose backward defers dW into the store captured at forward time."""

    @staticmethod
    def forward(
        ctx: Any,
        inputs: torch.Tensor,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(inputs, weight)
        # The parameter itself: what saved_tensors returns may be an alias of it (under
        # saved-tensor hooks), and dW must land in the parameter's own .grad.
        ctx.param = weight
        ctx.store = store
        return F.linear(inputs, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs, weight = ctx.saved_tensors
        needs_input, needs_weight, needs_bias, _ = ctx.needs_input_grad
        grad_input = grad_output.matmul(weight) if needs_input else None
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if needs_bias else None
        grad_weight = None
        if needs_weight:
            store: WeightGradStore | None = ctx.store
            if defers(store):
                param = ctx.param
                store.defer(lambda: accumulate_grad(param, _weight_grad(grad_output, inputs)))
            else:
                grad_weight = _weight_grad(grad_output, inputs)
        return grad_input, grad_weight, grad_bias, None


class DeferrableLinear(nn.Linear):
    """A drop-in ``nn.Linear`` whose weight gradient can be deferred to a W action.

    Outside an executor's forward (no active store) it behaves as ``nn.Linear``; so does
    its backward in a BW action, where the store is not capturing.
    """

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return _LinearFunction.apply(inputs, self.weight, self.bias, active_store())

    def deferred_parameters(self) -> Iterator[nn.Parameter]:
        yield self.weight


def make_deferrable(module: nn.Module) -> list[str]:
    """Turn every plain ``nn.Linear`` in ``module`` (itself included) into a
    :class:`DeferrableLinear`, in place, and return their qualified names.

    The modules stay the same objects (their class is switched), so parameters, buffers,
    hooks and optimizer references are untouched. Subclasses of ``nn.Linear`` are left
    alone: their forward may differ.
    """
    converted = []
    for name, child in module.named_modules():
        if type(child) is nn.Linear:
            child.__class__ = DeferrableLinear
            converted.append(name)
    return converted
