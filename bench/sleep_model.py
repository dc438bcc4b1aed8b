"""A model whose compute is timed sleeps, for measuring pipeline schedules on a few cores.

Sleeping ranks hold no core, so P of them run side by side on two cores while their
point-to-point traffic stays real. :class:`SleepLinear` is a real linear map whose input
node sleeps ``f`` in forward and ``b`` in backward and whose weight node sleeps ``w``, so
an input-gradient pass (``B`` / ``I``) and a later weight pass (``W``) each sleep only for
their own work; under an active :class:`WeightGradStore` it defers its weight work to the
store (:mod:`..runtime.deferrable`). :class:`SleepStage` stacks such layers behind a zero
entry parameter, so every stage has an input gradient; every sleep is timed on a
:class:`SleepClock`. Why sleeps, and why two nodes: docs/benchmark-method.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from megatron_dualpipe.runtime.weight_grad_store import (
    WeightGradStore,
    accumulate_grad,
    active_store,
    defers,
)

__all__ = ["SleepClock", "SleepCosts", "SleepLinear", "SleepStage"]


@dataclass(frozen=True)
class SleepCosts:
    """Seconds one layer sleeps: ``f`` in forward, ``b`` in its input-gradient (dX) pass,
    ``w`` in its weight-gradient (dW) pass."""

    f: float
    b: float
    w: float

    def __post_init__(self) -> None:
        if min(self.f, self.b, self.w) < 0:
            raise ValueError(f"sleep times must not be negative, got {self}")

    def scaled(self, factor: float) -> SleepCosts:
        """The same costs times ``factor`` (e.g. to split a stage's cost over its layers)."""
        return SleepCosts(self.f * factor, self.b * factor, self.w * factor)


@dataclass
class SleepClock:
    """Times every sleep: ``busy`` is their total in seconds; with ``record`` each sleep's
    ``(kind, start, end)`` (kind ``"F"``, ``"B"`` or ``"W"``; ``time.perf_counter`` seconds)
    is appended to ``events``."""

    record: bool = False
    busy: float = 0.0
    events: list[tuple[str, float, float]] = field(default_factory=list)

    def sleep(self, seconds: float, kind: str) -> None:
        """Sleep ``seconds`` (nothing for 0) and account for it."""
        if seconds <= 0:
            return
        start = time.perf_counter()
        time.sleep(seconds)
        end = time.perf_counter()
        self.busy += end - start
        if self.record:
            self.events.append((kind, start, end))

    def reset(self) -> None:
        self.busy = 0.0
        self.events.clear()


class _InputNode(torch.autograd.Function):
    """``x W^T`` with ``W`` detached: forward sleeps ``f``; backward sleeps ``b`` and
    returns the input gradient only."""

    @staticmethod
    def forward(ctx, x, weight, costs: SleepCosts, clock: SleepClock):  # type: ignore[override]
        clock.sleep(costs.f, "F")
        ctx.save_for_backward(weight)
        ctx.costs, ctx.clock = costs, clock
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        ctx.clock.sleep(ctx.costs.b, "B")
        (weight,) = ctx.saved_tensors
        return grad_out @ weight, None, None, None


def _weight_grads(
    grad_out: torch.Tensor, x: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return g.t() @ x.reshape(-1, x.shape[-1]), (g.sum(0) if has_bias else None)


class _WeightNode(torch.autograd.Function):
    """The bias (or zeros) broadcast to the output shape, on a detached input: forward does
    not sleep; backward sleeps ``w`` and returns the weight and bias gradients only, or,
    while ``store`` captures, defers exactly that to the store and returns none."""

    @staticmethod
    def forward(ctx, x, weight, bias, costs, clock, store):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.params = (weight, bias)  # the parameters themselves, for deferred accumulation
        ctx.costs, ctx.clock, ctx.store = costs, clock, store
        shape = (*x.shape[:-1], weight.shape[0])
        if bias is None:
            return x.new_zeros(shape)
        return bias.expand(shape).clone()

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        weight, bias = ctx.params
        costs, clock, store = ctx.costs, ctx.clock, ctx.store
        if defers(store):

            def work() -> None:
                clock.sleep(costs.w, "W")
                grad_weight, grad_bias = _weight_grads(grad_out, x, bias is not None)
                accumulate_grad(weight, grad_weight)
                if bias is not None:
                    accumulate_grad(bias, grad_bias)

            store.defer(work)
            return None, None, None, None, None, None
        clock.sleep(costs.w, "W")
        grad_weight, grad_bias = _weight_grads(grad_out, x, bias is not None)
        return None, grad_weight, grad_bias, None, None, None


class SleepLinear(nn.Module):
    """A linear layer (same math and gradients as ``nn.Linear``) whose forward, dX and dW
    passes sleep ``costs.f``, ``costs.b`` and ``costs.w`` seconds on ``clock``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        costs: SleepCosts,
        clock: SleepClock,
        bias: bool = True,
    ):
        super().__init__()
        reference = nn.Linear(in_features, out_features, bias=bias)
        self.weight = nn.Parameter(reference.weight.detach().clone())
        self.bias = nn.Parameter(reference.bias.detach().clone()) if bias else None
        self.costs, self.clock = costs, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        through_input = _InputNode.apply(x, self.weight.detach(), self.costs, self.clock)
        store: WeightGradStore | None = active_store()
        through_weight = _WeightNode.apply(
            x.detach(), self.weight, self.bias, self.costs, self.clock, store
        )
        return through_input + through_weight

    def deferred_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters whose gradient waits for a W action when deferral is on."""
        yield self.weight
        if self.bias is not None:
            yield self.bias


class SleepStage(nn.Module):
    """One pipeline stage: a zero entry parameter added to the input (so the stage has an
    input-gradient node even where its input needs no gradient), then ``layers``
    :class:`SleepLinear` of ``width`` features, each sleeping ``costs``."""

    def __init__(self, layers: int, width: int, costs: SleepCosts, clock: SleepClock):
        super().__init__()
        self.entry = nn.Parameter(torch.zeros(width))
        self.layers = nn.ModuleList(SleepLinear(width, width, costs, clock) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.entry
        for layer in self.layers:
            x = layer(x)
        return x
