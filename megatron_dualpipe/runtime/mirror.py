"""Gradient sync of DualPipe's two model copies.

In the ``mirror`` placement model stage s lives twice: as chunk 0 of rank s (direction 0)
and as chunk 1 of rank R-1-s (direction 1). Each copy sees half the micro-batches, so the
stage's gradient is the sum of both copies' gradients. :func:`sync_mirror_grads` swaps
gradients between partner ranks r and R-1-r and adds them; since both sides add the
same two numbers, the copies get bit-identical gradients and stay identical after any
deterministic optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..schedules.ir import Placement
from .p2p import TAG_LIMIT
from .watchdog import DEFAULT_TIMEOUT_S, Watchdog

__all__ = ["copy_mirror_params", "sync_mirror_grads"]

#: Above the executor's tags, so it never meets schedule traffic.
_TAG = TAG_LIMIT


def param_grad(param: nn.Parameter) -> torch.Tensor:
    """A parameter's ``.grad``, zeros where there is none yet."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def _grads(
    module: nn.Module, grad_of: Callable[[nn.Parameter], torch.Tensor]
) -> list[torch.Tensor]:
    return [grad_of(p) for p in module.parameters() if p.requires_grad]


def _check_pair(modules: Sequence[nn.Module], placement: Placement) -> None:
    if placement.kind != "mirror":
        raise ValueError(f"mirror copies need the mirror placement, not {placement.kind!r}")
    if len(modules) != 2:
        raise ValueError(f"a mirror rank holds 2 chunks, got {len(modules)} modules")


def copy_mirror_params(
    modules: Sequence[nn.Module],
    placement: Placement,
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Make this rank's chunk 1 a copy of its mirror rank's chunk 0 (direction 0's copy of
    each stage is the original). Collective over the pipeline ``group``."""
    _check_pair(modules, placement)
    partner = placement.num_ranks - 1 - rank
    params = [[p for p in m.parameters() if p.requires_grad] for m in modules]
    mine = torch.cat([p.detach().reshape(-1) for p in params[0] + params[1]])
    sizes = [sum(p.numel() for p in chunk) for chunk in params]
    theirs = _swap(mine, partner, group, Watchdog(rank, timeout_s))
    their_chunk0 = theirs.split(sizes[::-1])[0]
    with torch.no_grad():
        for param, value in zip(
            params[1], their_chunk0.split([p.numel() for p in params[1]]), strict=True
        ):
            param.copy_(value.view_as(param))


def sync_mirror_grads(
    modules: Sequence[nn.Module],
    placement: Placement,
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grad_of: Callable[[nn.Parameter], torch.Tensor] = param_grad,
) -> None:
    """Sum each model stage's gradients over its two copies, in place, on both.

    ``modules`` are this rank's two chunk modules (as given to the executor); the two
    copies of a stage must have the same parameters in the same order. ``grad_of`` says
    where a parameter's gradient lives (``.grad`` by default; Megatron's DDP keeps it in
    ``main_grad``). Call it on every rank of the pipeline ``group`` after the step and
    before the optimizer.
    """
    _check_pair(modules, placement)
    partner = placement.num_ranks - 1 - rank
    watchdog = Watchdog(rank, timeout_s)
    own = [_grads(modules[0], grad_of), _grads(modules[1], grad_of)]
    # My chunk 0 is the partner's chunk 1 and the other way round: check sizes first.
    mine = torch.cat([g.reshape(-1) for g in own[0] + own[1]])
    sizes = [sum(g.numel() for g in grads) for grads in own]
    their_sizes = _swap(torch.tensor(sizes, device=mine.device), partner, group, watchdog)
    if their_sizes.tolist() != sizes[::-1]:
        raise ValueError(
            f"rank {rank}'s chunks hold {sizes} gradient elements but its mirror rank "
            f"{partner}'s hold {their_sizes.tolist()}: the two copies of a stage must match"
        )
    partner_chunk0, partner_chunk1 = _swap(mine, partner, group, watchdog).split(sizes[::-1])
    for grads, other in ((own[0], partner_chunk1), (own[1], partner_chunk0)):
        offset = 0
        for grad in grads:
            grad.add_(other[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _swap(
    tensor: torch.Tensor, partner: int, group: dist.ProcessGroup | None, watchdog: Watchdog
) -> torch.Tensor:
    """Send ``tensor`` to ``partner`` and return the partner's tensor of the same shape."""
    theirs = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, group=group, tag=_TAG, group_peer=partner),
        dist.P2POp(dist.irecv, theirs, group=group, tag=_TAG, group_peer=partner),
    ]
    for work in dist.batch_isend_irecv(ops):
        watchdog.wait(work, "the mirror copy's gradients", partner)
    return theirs
