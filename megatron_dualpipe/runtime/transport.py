"""How the batches of a communication plan reach a torch.distributed backend.

A :class:`Transport` takes one :class:`~megatron_dualpipe.schedules.comm_plan.Issue` at a
time, as element operations (a message of several tensors is one operation per tensor,
in order), and returns one handle per operation. Handles have ``wait()`` and
``is_completed()``; :attr:`Transport.host_waits` says how the executor waits on them:

- ``"timed"`` (gloo): ``wait(timeout)`` blocks the host with a deadline; gloo's works
  only learn that they completed when waited on (``is_completed()`` stays False until
  then), so the executor waits on sends in a helper thread;
- ``"stream"`` (NCCL and the NCCL-rules emulation): ``wait()`` without a timeout (on NCCL
  it only makes the compute stream wait, so the host runs ahead of the GPU), and a side
  thread watches ``is_completed()`` for hangs (:class:`~.watchdog.HangMonitor`).

:class:`GroupTransport` runs the plan on one process group: under gloo, which matches by
tag, any plan; under NCCL, which matches the messages between two ranks in issue order,
the lock-step plan's one communicator, a group over the pipeline's ranks made by
:func:`make_pipeline_group` (only its members take part; on NCCL with a high-priority
stream, see :func:`pipeline_group_options`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..schedules.comm_plan import Comm, CommOp
from .watchdog import Watchdog

__all__ = [
    "ElementOp",
    "GroupTransport",
    "Handle",
    "Transport",
    "make_member_group",
    "make_pipeline_group",
    "pipeline_group_options",
]


@dataclass(frozen=True, slots=True)
class ElementOp:
    """One tensor of one message of the plan: the plan's op, which element, the tensor
    (the data to send, or the buffer to receive into) and the message tag."""

    op: CommOp
    element: int
    tensor: torch.Tensor
    tag: int


class Handle(Protocol):
    def wait(self, timeout: timedelta = ...) -> object: ...

    def is_completed(self) -> bool: ...


class Transport(Protocol):
    """Hands a plan's batches to a backend (see the module docstring)."""

    host_waits: str  # "timed" or "stream"

    def setup(self, comm: Comm, rank: int, peers: Sequence[int], watchdog: Watchdog) -> None:
        """Set ``comm`` up now and connect ``rank`` to the ``peers`` it talks to on it
        (its members call this in the same order)."""

    def start(self, comm: Comm, ops: Sequence[ElementOp]) -> list[Handle]:
        """Issue ``ops`` (all on ``comm``) as one batch; a handle per op, in order."""

    def abort(self) -> None:
        """Make every pending operation fail (after a hang was detected)."""

    def close(self) -> None:
        """Release what the transport holds (helper threads); it is not used again."""


class GroupTransport:
    """The plan's batches on process group ``group``. ``ranks`` are the pipeline ranks'
    global ranks (pipeline rank ``i`` is ``ranks[i]``). ``device`` is where the messages'
    tensors live: on the CPU (gloo) each operation is issued alone, with its tag, and
    waited with a deadline; elsewhere (NCCL, which ignores tags: one communicator per
    plan) each batch is one ``batch_isend_irecv`` and waits do not block the host.
    ``batched`` forces the batch path on the CPU too (to test it over gloo, which then
    matches messages in issue order as NCCL does)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        ranks: Sequence[int],
        *,
        device: torch.device | None = None,
        batched: bool | None = None,
    ):
        self.group = group
        self.device = device or torch.device("cpu")
        on_cpu = self.device.type == "cpu"
        self._batched = not on_cpu if batched is None else batched
        self.host_waits = "timed" if on_cpu else "stream"
        self._ranks = list(ranks)
        self._peers: dict[int, int] = {}
        self._comm: Comm | None = None

    def _peer(self, pipeline_rank: int) -> int:
        """``pipeline_rank``'s rank in the group (looked up once)."""
        peer = self._peers.get(pipeline_rank)
        if peer is None:
            peer = dist.get_group_rank(self.group, self._ranks[pipeline_rank])
            self._peers[pipeline_rank] = peer
        return peer

    def setup(self, comm: Comm, rank: int, peers: Sequence[int], watchdog: Watchdog) -> None:
        """On the batch path: set the communicator up and connect ``rank`` to its
        ``peers``, one small message each way in one batch, waited on (NCCL creates
        communicators and connections on first use, blocking each member until the others
        arrive). Refuses a second communicator where tags are ignored."""
        if not self._batched:
            return
        if self._comm is not None and comm != self._comm:
            raise ValueError(
                f"the plan uses communicators {self._comm} and {comm} but messages on "
                f"{self.device} ignore tags: run the lock-step plan (one communicator)"
            )
        self._comm = comm
        order = [peer for peer in sorted(peers) for _ in range(2)]  # a send, a receive each
        probes = [
            dist.P2POp(
                dist.isend if i % 2 == 0 else dist.irecv,
                torch.zeros(1, device=self.device),
                group=self.group,
                group_peer=self._peer(peer),
            )
            for i, peer in enumerate(order)
        ]
        if probes:
            # A coalesced batch returns one work: it stands for every probe.
            for work, peer in zip(dist.batch_isend_irecv(probes), order, strict=False):
                watchdog.wait(work, f"the set-up of communicator {comm}", peer)

    def start(self, comm: Comm, ops: Sequence[ElementOp]) -> list[Handle]:
        if not self._batched:
            return [self._gloo_op(op) for op in ops]
        batch = [
            dist.P2POp(
                dist.isend if op.op.kind == "send" else dist.irecv,
                op.tensor,
                group=self.group,
                group_peer=self._peer(op.op.peer),
            )
            for op in ops
        ]
        works = dist.batch_isend_irecv(batch)
        # A coalesced batch may return one work for all its ops.
        return works if len(works) == len(ops) else [works[-1]] * len(ops)

    def _gloo_op(self, op: ElementOp) -> Handle:
        call = self.group.send if op.op.kind == "send" else self.group.recv
        return call([op.tensor], self._peer(op.op.peer), op.tag)

    def abort(self) -> None:
        """Abort the group: every pending operation fails."""
        self.group.abort()

    def close(self) -> None:
        """Nothing to release: the group belongs to whoever made it."""


def pipeline_group_options(backend: str) -> Any | None:
    """The options a pipeline group of ``backend`` is made with: on NCCL, a stream from
    the high-priority pool (``is_high_priority_stream``), where fewer of the process's
    streams are drawn, so it is less likely to be shared. A mitigation only: the plan
    does not rely on it (see :mod:`~megatron_dualpipe.schedules.exchange`). None
    elsewhere (the backend's defaults)."""
    if backend != "nccl" or not dist.is_nccl_available():
        return None
    return dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)


def make_pipeline_group(
    pipeline_group: dist.ProcessGroup | None = None, *, timeout: timedelta | None = None
) -> dist.ProcessGroup:
    """A process group over the ranks of ``pipeline_group`` (default: the world) for the
    lock-step plan's communicator, made by those ranks only (see
    :func:`make_member_group`). ``timeout`` is the group's own (give more than the
    executor's, so that its hang monitor names a hang before the backend's watchdog ends
    the process)."""
    parent = pipeline_group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(parent)
    return make_member_group(parent, [list(range(len(ranks)))], timeout=timeout)


def make_member_group(
    parent: dist.ProcessGroup,
    splits: Sequence[Sequence[int]],
    *,
    timeout: timedelta | None = None,
) -> dist.ProcessGroup:
    """The group of this rank's split of ``parent`` (``splits``: disjoint lists of
    ``parent``'s group ranks, one holding this rank), with :func:`pipeline_group_options`,
    made by its members only: split from ``parent`` where the default group is bound to a
    device (every rank of ``parent`` calls, with the same ``splits``; torch would
    otherwise split the world's communicator, with every rank of the world taking part),
    else a ``new_group`` with local synchronisation (only the split's members call)."""
    ranks = dist.get_process_group_ranks(parent)
    options = pipeline_group_options(dist.get_backend(parent))
    if dist.group.WORLD.bound_device_id is not None:
        return dist.split_group(
            parent, [list(split) for split in splits], timeout=timeout, pg_options=options
        )
    me = dist.get_group_rank(parent, dist.get_rank())
    mine = next(split for split in splits if me in split)
    return dist.new_group(
        [ranks[i] for i in mine],
        timeout=timeout,
        pg_options=options,
        use_local_synchronization=True,
    )
