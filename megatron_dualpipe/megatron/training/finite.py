"""Megatron-LM's ``check_for_nan_in_loss_and_grad``: which ranks saw a NaN or an Inf.

Megatron-LM checks each rank's loss in its loss function and each rank's gradient buckets
before the data-parallel reduction (``DistributedDataParallelConfig.check_for_nan_in_grad``)
and raises on the rank that saw it; its peers then wait in their next collective until the
launcher or the timeout ends them. Here every rank contributes its own flags to one
all-reduce after the forward-backward step, so all ranks learn together which ranks saw
what and stop together, before the optimizer step, with the same sentence.

The same quantities are checked: each micro-batch's loss on the ranks that compute one,
and the L2 norm of each gradient buffer of each model chunk (Megatron's per-bucket norm;
an overflowing norm of finite gradients counts as Inf, as there). Gradients are only
checked where no loss scaler is at work: under dynamic loss scaling an Inf gradient is an
overflow that Megatron's optimizer answers by skipping the step and lowering the scale.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["FINDINGS", "describe", "grad_buffers", "local_flags", "uses_loss_scaling"]

#: What each flag means, in the order of :func:`local_flags`.
FINDINGS = ("NaN in the loss", "Inf in the loss", "NaN in the gradients", "Inf in the gradients")


def uses_loss_scaling(optimizer: Any) -> bool:
    """Whether a Megatron optimizer (or any optimizer of a chained one) has a grad scaler."""
    optimizers = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(getattr(o, "grad_scaler", None) is not None for o in optimizers)


def grad_buffers(model: Iterable[Any]) -> list[torch.Tensor]:
    """The gradient buffers of Megatron DDP model chunks (dense and expert-parallel)."""
    return [
        buffer.grad_data
        for chunk in model
        for buffer in (*chunk.buffers, *chunk.expert_parallel_buffers)
    ]


def local_flags(losses: Sequence[float], grads: Iterable[torch.Tensor]) -> list[int]:
    """This rank's flags, one per :data:`FINDINGS` entry: 1 where it saw that."""
    flags = [0] * len(FINDINGS)
    for loss in losses:
        flags[0] |= math.isnan(loss)
        flags[1] |= math.isinf(loss)
    for grad in grads:
        norm = float(grad.norm(p=2))
        flags[2] |= math.isnan(norm)
        flags[3] |= math.isinf(norm)
    return flags


def describe(flags_by_rank: Sequence[Sequence[float]]) -> str | None:
    """``"NaN in the loss on rank 0 and Inf in the gradients on ranks 0, 1"``, or None
    when no rank flagged anything; ``flags_by_rank[r]`` are rank r's flags."""
    parts = []
    for i, finding in enumerate(FINDINGS):
        ranks = [r for r, flags in enumerate(flags_by_rank) if flags[i]]
        if ranks:
            where = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
            parts.append(f"{finding} on {where}")
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
