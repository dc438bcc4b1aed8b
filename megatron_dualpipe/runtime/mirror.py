"""Gradient sync of DualPipe's two model copies, in place, one bucket at a time.

In the ``mirror`` placement model stage s lives twice: as chunk 0 of rank s (direction 0)
and as chunk 1 of rank R-1-s (direction 1). :meth:`MirrorPair.copy_params` makes the
second copy equal to the first; :meth:`MirrorPair.sync_grads` sums the two copies'
gradients bucket by bucket between partner ranks r and R-1-r, leaving both bit-identical.
The exchanges run on the pipeline group, at most :data:`IN_FLIGHT` issued and not yet
waited; no wait blocks the host with a timeout, and a :class:`~.watchdog.HangMonitor`
turns one pending past the timeout into a :class:`~.watchdog.PipelineWaitError` naming
both ranks. How and why: docs/runtime.md, "Compute" ("Mirrors").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import zip_longest

import torch
import torch.distributed as dist
from torch import nn

from ..schedules.ir import Placement
from .transport import TAG_LIMIT
from .watchdog import DEFAULT_TIMEOUT_S, HangMonitor, PipelineCommError, Watchdog

__all__ = [
    "BUCKET_BYTES",
    "IN_FLIGHT",
    "Buckets",
    "MirrorPair",
    "param_buckets",
    "sync_mirror_grads",
]

#: Above the executor's tags, so it never meets schedule traffic.
_TAG = TAG_LIMIT
#: The largest bucket :func:`param_buckets` makes, in bytes (one tensor may exceed it alone).
BUCKET_BYTES = 64 * 2**20
#: The most exchanges a rank has issued and not yet waited on.
IN_FLIGHT = 2

#: A chunk's tensors to exchange, grouped into buckets (each tensor contiguous).
Buckets = list[list[torch.Tensor]]
#: One exchange: the tensors sent, the buffers received into, what to run once received.
_Exchange = tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], None] | None]


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


class MirrorPair:
    """Pipeline rank ``rank`` and its mirror rank (R-1-r), exchanging on the pipeline
    ``group`` (default: the world). Hold one for repeated exchanges; ``timeout_s`` bounds
    each wait (see docs/runtime.md, "Mirrors"); ``bucket_bytes`` is the most bytes a bucket of
    :func:`param_buckets` holds where the caller gives no buckets of its own;
    ``watch_paused``: the hang monitor's ``paused`` (:class:`~.watchdog.HangMonitor`)."""

    def __init__(
        self,
        placement: Placement,
        rank: int,
        *,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        bucket_bytes: int = BUCKET_BYTES,
        watch_paused: Callable[[], bool] | None = None,
    ):
        self.placement = placement
        self.rank = rank
        self.partner = placement.num_ranks - 1 - rank
        self.bucket_bytes = bucket_bytes
        self.watchdog = Watchdog(rank, timeout_s)
        self.group = group or dist.group.WORLD
        self._peer = self.partner
        # Watches every exchange until it completes, also after the call that issued it
        # returned (on NCCL the GPU may still be exchanging then); its thread ends with
        # the pair, or at :meth:`close`.
        self._monitor = HangMonitor(self.watchdog, self.group.abort, paused=watch_paused)

    def check(self) -> None:
        """Raise the hang the pair's monitor saw, if any (every exchange checks first)."""
        self._monitor.check()

    def close(self) -> None:
        """Stop watching (the pair is not used again)."""
        self._monitor.close()

    def _issue(self, sends: list[torch.Tensor], receives: list[torch.Tensor], what: str) -> list:
        """Send ``sends`` to the partner and receive into ``receives``, one batch (the
        partner issues the same batch); its works."""
        group, peer = self.group, self._peer
        ops = [dist.P2POp(dist.isend, t, group=group, tag=_TAG, group_peer=peer) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, group=group, tag=_TAG, group_peer=peer) for t in receives]
        with self.watchdog.guard(what, self.partner):
            return dist.batch_isend_irecv(ops)

    def _finish(self, works: list, then: Callable[[], None] | None, what: str) -> None:
        """Wait for ``works`` (the current stream waits, the host does not), then ``then``."""
        monitor = self._monitor
        for work in works:
            monitor.waiting(work)
            try:
                with self.watchdog.guard(what, self.partner):
                    work.wait()
            except PipelineCommError as error:
                if monitor.error is not None:
                    raise monitor.error from error
                raise
        monitor.poll()  # forget what completed (on gloo: all of it), with its buffers
        monitor.check()
        if then is not None:
            then()

    def run(self, exchanges: Iterable[_Exchange], what: str) -> None:
        """Run ``exchanges`` in order, at most :data:`IN_FLIGHT` issued and not waited; each
        one's receives are made (and ``then`` run) when the iterator yields it."""
        self.check()
        pending: deque[tuple[list, Callable[[], None] | None]] = deque()
        upcoming = iter(exchanges)
        while True:
            if len(pending) == IN_FLIGHT:  # before the next one's buffers are made
                self._finish(*pending.popleft(), what)
            exchange = next(upcoming, None)
            if exchange is None:
                break
            sends, receives, then = exchange
            works = self._issue(sends, receives, what)
            for work in works:
                self._monitor.watch(work, what, self.partner)
            pending.append((works, then))
            del exchange, sends, receives, then  # held by ``pending`` only
        while pending:
            self._finish(*pending.popleft(), what)

    def swap_ints(self, values: list[int], device: torch.device) -> list[int]:
        """Send ``values`` and return the partner's list (as int64 tensors on ``device``:
        the backend's, e.g. NCCL's CUDA)."""
        what = "the mirror copy's layout"
        length = torch.tensor([len(values)], device=device)
        theirs_length = torch.empty(1, dtype=torch.int64, device=device)
        self.run([([length], [theirs_length], None)], what)
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        theirs = torch.empty(int(theirs_length.item()), dtype=torch.int64, device=device)
        self.run([([mine], [theirs], None)], what)
        return theirs.tolist()

    def check_layouts(self, ours: Sequence[list[list[int]]], device: torch.device) -> None:
        """Raise ValueError unless this rank's chunk 0 is laid out as the partner's chunk 1
        and the other way round; ``ours[c]`` describes chunk c's buckets, each a list of
        numbers (e.g. element counts), sent on ``device`` (the backend's)."""
        ours = [list(c) for c in ours]
        theirs = _decode(self.swap_ints(_encode(ours), device))
        if theirs != ours[::-1]:
            raise ValueError(
                f"rank {self.rank}'s two chunks hold buckets of {ours} elements and its mirror "
                f"rank {self.partner}'s {theirs}: the two copies of a stage must hold the same "
                "parameters in the same buckets"
            )

    def copy_params(self, modules: Sequence[nn.Module]) -> None:
        """Make this rank's chunk 1 a copy of the partner's chunk 0 (direction 0's copy of
        each stage is the original), received in place. Collective over the pair's group."""
        _check_pair(modules, self.placement)
        mine = [param_buckets(m, lambda p: p.data, self.bucket_bytes) for m in modules]
        self.check_layouts([_layout(c) for c in mine], _device(mine))
        with torch.no_grad():
            self.run(
                ((send, receive, None) for send, receive in _paired(mine[0], mine[1])),
                "the mirror copy's parameters",
            )

    def sync_grads(
        self,
        modules: Sequence[nn.Module],
        *,
        grad_of: Callable[[nn.Parameter], torch.Tensor] = param_grad,
        buckets: Callable[[nn.Module], Buckets] | None = None,
        check_layout: bool = True,
    ) -> None:
        """Sum each model stage's gradients over its two copies (see
        :func:`sync_mirror_grads`)."""
        _check_pair(modules, self.placement)
        bucketing = buckets or (lambda m: param_buckets(m, grad_of, self.bucket_bytes))
        mine = [bucketing(m) for m in modules]
        if check_layout:
            self.check_layouts([_layout(c) for c in mine], _device(mine))
        what = "the mirror copy's gradients"
        self.run((_add_into(s, a) for s, a in _paired(mine[0], mine[1])), what)
        self.run(((s, o, None) for s, o in _paired(mine[1], mine[0])), what)


def _paired(sent: Buckets, received: Buckets) -> Iterable[tuple[list, list]]:
    """Exchange i's sends (``sent[i]``) and receive buffers (``received[i]``, laid out as
    the partner's ``sent[i]``): as many exchanges as the longer list, an empty side where
    one list has ended (docs/runtime.md, "Mirrors")."""
    return zip_longest(sent, received, fillvalue=[])


def _add_into(send: list[torch.Tensor], add_to: list[torch.Tensor]) -> _Exchange:
    """Send ``send``, receive the partner's bucket into a fresh buffer and add it into
    ``add_to`` once received (the buffer goes with the exchange)."""
    received = [torch.empty_like(t) for t in add_to]

    def add() -> None:
        for total, other in zip(add_to, received, strict=True):
            total.add_(other)

    return send, received, add


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


def sync_mirror_grads(
    modules: Sequence[nn.Module],
    placement: Placement,
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grad_of: Callable[[nn.Parameter], torch.Tensor] = param_grad,
    buckets: Callable[[nn.Module], Buckets] | None = None,
) -> None:
    """Sum each model stage's gradients over its two copies, in place, on both, on a
    :class:`MirrorPair` made for this call (hold a pair across steps instead:
    :meth:`MirrorPair.sync_grads`).

    ``modules`` are this rank's two chunk modules (as given to the executor). A chunk's
    gradients are exchanged in ``buckets(chunk)`` (default: ``grad_of`` of its parameters,
    in buckets of :data:`BUCKET_BYTES`); the partner's chunk 1 must be bucketed as this
    rank's chunk 0, which is checked first. Call it on every rank of the pipeline ``group``
    after the step and before the optimizer.
    """
    pair = MirrorPair(placement, rank, group=group, timeout_s=timeout_s)
    pair.sync_grads(modules, grad_of=grad_of, buckets=buckets)
