"""Gradient sync of DualPipe's two model copies, in place, one bucket at a time.

In the ``mirror`` placement model stage s lives twice: as chunk 0 of rank s (direction 0)
and as chunk 1 of rank R-1-s (direction 1). Each copy sees half the micro-batches, so the
stage's gradient is the sum of both copies' gradients. Partner ranks r and R-1-r hold the
same two stages the other way round, and :func:`sync_mirror_grads` sums them bucket by
bucket, the only memory it takes being one bucket's receive buffer:

1. each rank sends its chunk 0's bucket and adds the partner's (the other copy of its
   chunk 1's stage) into its chunk 1, which is then final;
2. each rank sends its chunk 1's (final) bucket, which the partner receives straight into
   its chunk 0.

Both copies end bit-identical (the sum is formed once, on the chunk-1 side, and copied), so
they stay identical after any deterministic optimizer step. Each exchange is one batch of a
rank's sends and receives to its partner, the same batches in the same order on both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..schedules.ir import Placement
from .p2p import TAG_LIMIT
from .watchdog import DEFAULT_TIMEOUT_S, Watchdog

__all__ = [
    "BUCKET_BYTES",
    "Buckets",
    "check_mirror_layouts",
    "copy_mirror_params",
    "param_buckets",
    "sync_mirror_grads",
]

#: Above the executor's tags, so it never meets schedule traffic.
_TAG = TAG_LIMIT
#: The largest bucket :func:`param_buckets` makes, in bytes (one tensor may exceed it alone).
BUCKET_BYTES = 64 * 2**20

#: A chunk's tensors to exchange, grouped into buckets (each tensor contiguous).
Buckets = list[list[torch.Tensor]]


def param_grad(param: nn.Parameter) -> torch.Tensor:
    """A parameter's ``.grad``, zeros where there is none yet."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def param_buckets(
    module: nn.Module,
    tensor_of: Callable[[nn.Parameter], torch.Tensor],
    bucket_bytes: int = BUCKET_BYTES,
) -> Buckets:
    """``tensor_of(p)`` for each trainable parameter of ``module``, in order, grouped into
    buckets of at most ``bucket_bytes``."""
    buckets: Buckets = [[]]
    size = 0
    for param in module.parameters():
        if not param.requires_grad:
            continue
        tensor = tensor_of(param)
        if not tensor.is_contiguous():
            raise ValueError("mirror exchange: a parameter's tensor is not contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return [b for b in buckets if b]


def _check_pair(modules: Sequence[nn.Module], placement: Placement) -> None:
    if placement.kind != "mirror":
        raise ValueError(f"mirror copies need the mirror placement, not {placement.kind!r}")
    if len(modules) != 2:
        raise ValueError(f"a mirror rank holds 2 chunks, got {len(modules)} modules")


def _exchange(
    sends: list[torch.Tensor],
    receives: list[torch.Tensor],
    partner: int,
    group: dist.ProcessGroup | None,
    watchdog: Watchdog,
    what: str,
) -> None:
    """Send ``sends`` to ``partner`` and receive its tensors into ``receives``, one batch."""
    ops = [dist.P2POp(dist.isend, t, group=group, tag=_TAG, group_peer=partner) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, tag=_TAG, group_peer=partner) for t in receives]
    for work in dist.batch_isend_irecv(ops):
        watchdog.wait(work, what, partner)


def _swap_ints(
    values: list[int], partner: int, group, watchdog: Watchdog, device: torch.device
) -> list[int]:
    """Send ``values`` to ``partner`` and return the partner's list (as int64 tensors on
    ``device``: the backend's, e.g. NCCL's CUDA)."""
    what = "the mirror copy's layout"
    length = torch.tensor([len(values)], device=device)
    theirs_length = torch.empty(1, dtype=torch.int64, device=device)
    _exchange([length], [theirs_length], partner, group, watchdog, what)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    theirs = torch.empty(int(theirs_length.item()), dtype=torch.int64, device=device)
    _exchange([mine], [theirs], partner, group, watchdog, what)
    return theirs.tolist()


def _device(chunks: list[Buckets]) -> torch.device:
    """Where a rank's exchanged tensors live (the backend's device)."""
    first = next((t for chunk in chunks for bucket in chunk for t in bucket), None)
    return torch.device("cpu") if first is None else first.device


def _layout(chunk: Buckets) -> list[list[int]]:
    """A chunk's buckets as the element counts of their tensors."""
    return [[t.numel() for t in bucket] for bucket in chunk]


def _encode(chunks: list[list[list[int]]]) -> list[int]:
    flat = []
    for chunk in chunks:
        flat.append(len(chunk))
        for bucket in chunk:
            flat += [len(bucket), *bucket]
    return flat


def _decode(flat: list[int]) -> list[list[list[int]]]:
    values = iter(flat)
    chunks = []
    for _ in range(2):
        chunk = []
        for _ in range(next(values)):
            chunk.append([next(values) for _ in range(next(values))])
        chunks.append(chunk)
    return chunks


def check_mirror_layouts(
    layouts: Sequence[list[list[int]]],
    placement: Placement,
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device: torch.device | None = None,
) -> None:
    """Raise ValueError unless this rank's chunk 0 is laid out as its mirror rank's chunk 1
    and the other way round; ``layouts[c]`` describes chunk c's buckets, each a list of
    numbers (e.g. element counts). Collective over the pipeline ``group``; the layouts
    travel on ``device`` (the gradients' device: CPU for gloo, CUDA for NCCL)."""
    partner = placement.num_ranks - 1 - rank
    watchdog = Watchdog(rank, timeout_s)
    device = device or torch.device("cpu")
    _check_layouts([list(c) for c in layouts], partner, rank, group, watchdog, device)


def _check_layouts(
    ours: list[list[list[int]]], partner: int, rank: int, group, watchdog, device
) -> None:
    """My chunk 0 must be bucketed as the partner's chunk 1, and the other way round."""
    theirs = _decode(_swap_ints(_encode(ours), partner, group, watchdog, device))
    if theirs != ours[::-1]:
        raise ValueError(
            f"rank {rank}'s two chunks hold buckets of {ours} elements and its mirror rank "
            f"{partner}'s {theirs}: the two copies of a stage must hold the same parameters "
            "in the same buckets"
        )


def copy_mirror_params(
    modules: Sequence[nn.Module],
    placement: Placement,
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Make this rank's chunk 1 a copy of its mirror rank's chunk 0 (direction 0's copy of
    each stage is the original), received in place. Collective over the pipeline ``group``."""
    _check_pair(modules, placement)
    partner = placement.num_ranks - 1 - rank
    watchdog = Watchdog(rank, timeout_s)
    mine = [param_buckets(m, lambda p: p.data) for m in modules]
    _check_layouts([_layout(c) for c in mine], partner, rank, group, watchdog, _device(mine))
    with torch.no_grad():
        for send, receive in zip(mine[0], mine[1], strict=True):
            _exchange(send, receive, partner, group, watchdog, "the mirror copy's parameters")


def sync_mirror_grads(
    modules: Sequence[nn.Module],
    placement: Placement,
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grad_of: Callable[[nn.Parameter], torch.Tensor] = param_grad,
    buckets: Callable[[nn.Module], Buckets] | None = None,
    check_layout: bool = True,
) -> None:
    """Sum each model stage's gradients over its two copies, in place, on both.

    ``modules`` are this rank's two chunk modules (as given to the executor). A chunk's
    gradients are exchanged in ``buckets(chunk)`` (default: ``grad_of`` of its parameters,
    in buckets of :data:`BUCKET_BYTES`); the partner's chunk 1 must be bucketed as this
    rank's chunk 0, which is checked first unless ``check_layout`` is off (a caller that
    checked once, see :func:`check_mirror_layouts`). Call it on every rank of the pipeline
    ``group`` after the step and before the optimizer.
    """
    _check_pair(modules, placement)
    partner = placement.num_ranks - 1 - rank
    watchdog = Watchdog(rank, timeout_s)
    bucketing = buckets or (lambda m: param_buckets(m, grad_of))
    mine = [bucketing(m) for m in modules]
    if check_layout:
        _check_layouts([_layout(c) for c in mine], partner, rank, group, watchdog, _device(mine))
    what = "the mirror copy's gradients"
    for send, add_to in zip(mine[0], mine[1], strict=True):  # 1: chunk 1 gets the sum
        _add_from_partner(send, add_to, partner, group, watchdog, what)
    for send, overwrite in zip(mine[1], mine[0], strict=True):  # 2: chunk 0 gets it too
        _exchange(send, overwrite, partner, group, watchdog, what)


def _add_from_partner(
    send: list[torch.Tensor],
    add_to: list[torch.Tensor],
    partner: int,
    group: dist.ProcessGroup | None,
    watchdog: Watchdog,
    what: str,
) -> None:
    """Send ``send``, receive the partner's bucket and add it into ``add_to``; the receive
    buffer (one bucket) is gone on return."""
    received = [torch.empty_like(t) for t in add_to]
    _exchange(send, received, partner, group, watchdog, what)
    for total, other in zip(add_to, received, strict=True):
        total.add_(other)
