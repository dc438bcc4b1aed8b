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

:class:`GroupTransport` maps each communicator of the plan to a process group: one group
for all (gloo, which matches by tag) or one two-rank group per channel (NCCL, which
matches in issue order; see :func:`make_channel_groups`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from ..schedules.comm_plan import Comm, CommOp
from .watchdog import Watchdog

__all__ = [
    "ElementOp",
    "GroupTransport",
    "Handle",
    "Transport",
    "make_channel_groups",
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

    def setup(self, comm: Comm, rank: int, watchdog: Watchdog) -> None:
        """Set ``comm`` up now (its members call this in the same order)."""

    def start(self, comm: Comm, ops: Sequence[ElementOp]) -> list[Handle]:
        """Issue ``ops`` (all on ``comm``) as one batch; a handle per op, in order."""

    def abort(self) -> None:
        """Make every pending operation fail (after a hang was detected)."""

    def close(self) -> None:
        """Release what the transport holds (helper threads); it is not used again."""


class GroupTransport:
    """The plan's communicators on process groups: ``groups`` maps each communicator to
    its group, or is one group for all (where the backend matches by tag). ``ranks`` are
    the pipeline ranks' global ranks (pipeline rank ``i`` is ``ranks[i]``). ``device`` is
    where the messages' tensors live: on the CPU (gloo) each operation is issued alone,
    with its tag, and waited with a deadline; elsewhere (NCCL) each batch is one
    ``batch_isend_irecv`` on its communicator's group and waits do not block the host.
    ``batched`` forces the batch path on the CPU too (to test it over gloo)."""

    def __init__(
        self,
        groups: dist.ProcessGroup | Mapping[Comm, dist.ProcessGroup],
        ranks: Sequence[int],
        *,
        device: torch.device | None = None,
        batched: bool | None = None,
    ):
        self._one = groups if isinstance(groups, dist.ProcessGroup) else None
        self._groups = {} if self._one is not None else dict(groups)
        self.device = device or torch.device("cpu")
        on_cpu = self.device.type == "cpu"
        if self._one is not None and not on_cpu:
            raise ValueError(
                f"NCCL ignores message tags: give each communicator of the plan its own "
                f"group (make_channel_groups) for messages on {self.device}"
            )
        self._batched = not on_cpu if batched is None else batched
        self.host_waits = "timed" if on_cpu else "stream"
        self._ranks = list(ranks)
        self._peers: dict[tuple[Comm, int], int] = {}

    def group(self, comm: Comm) -> dist.ProcessGroup:
        if self._one is not None:
            return self._one
        try:
            return self._groups[comm]
        except KeyError:
            raise ValueError(f"no process group for communicator {comm}") from None

    def _peer(self, comm: Comm, pipeline_rank: int) -> int:
        """``pipeline_rank``'s rank in ``comm``'s group (looked up once)."""
        peer = self._peers.get((comm, pipeline_rank))
        if peer is None:
            peer = dist.get_group_rank(self.group(comm), self._ranks[pipeline_rank])
            self._peers[(comm, pipeline_rank)] = peer
        return peer

    def setup(self, comm: Comm, rank: int, watchdog: Watchdog) -> None:
        """Set a channel's communicator up and connect its two ranks: one small message
        from sender to receiver, waited on (NCCL creates communicators and connections
        on first use, blocking each member until the other arrives)."""
        if self._one is not None:
            return
        group = self.group(comm)
        probe = torch.zeros(1, device=self.device)
        send = rank == comm.ranks[0]
        peer = comm.ranks[1] if send else comm.ranks[0]
        op = dist.P2POp(
            dist.isend if send else dist.irecv,
            probe,
            group=group,
            group_peer=self._peer(comm, peer),
        )
        for work in dist.batch_isend_irecv([op]):
            watchdog.wait(work, f"the set-up of communicator {comm}", peer)

    def start(self, comm: Comm, ops: Sequence[ElementOp]) -> list[Handle]:
        group = self.group(comm)
        if not self._batched:
            return [self._gloo_op(group, comm, op) for op in ops]
        batch = [
            dist.P2POp(
                dist.isend if op.op.kind == "send" else dist.irecv,
                op.tensor,
                group=group,
                group_peer=self._peer(comm, op.op.peer),
            )
            for op in ops
        ]
        works = dist.batch_isend_irecv(batch)
        # A coalesced batch may return one work for all its ops.
        return works if len(works) == len(ops) else [works[-1]] * len(ops)

    def _gloo_op(self, group: dist.ProcessGroup, comm: Comm, op: ElementOp) -> Handle:
        peer = self._peer(comm, op.op.peer)
        call = group.send if op.op.kind == "send" else group.recv
        return call([op.tensor], peer, op.tag)

    def abort(self) -> None:
        """Abort every group, on NCCL inside one NCCL group: aborting communicators one by
        one can hang where another's kernel is stuck (as torch's ``_abort_process_group``
        does for all groups, pytorch issue 119797)."""
        every = [self._one] if self._one is not None else list(self._groups.values())
        groups = list(dict.fromkeys(every))
        backend = None
        if groups and self.device.type == "cuda":
            try:
                backend = groups[0]._get_backend(self.device)
            except RuntimeError:
                backend = None
        start, end = getattr(backend, "_group_start", None), getattr(backend, "_group_end", None)
        if start is not None and end is not None:
            start()
        for group in groups:
            group.abort()
        if start is not None and end is not None:
            end()

    def close(self) -> None:
        """Nothing to release: the groups belong to whoever made them."""


def make_channel_groups(
    comms: Sequence[Comm],
    pipeline_group: dist.ProcessGroup | None = None,
    *,
    timeout: timedelta | None = None,
) -> dict[Comm, dist.ProcessGroup]:
    """A two-rank process group per communicator in ``comms`` (channels over pipeline
    ranks of ``pipeline_group``), for every pipeline of the world.

    Collective over the whole world, as creating groups is: every rank learns every
    pipeline group's ranks and creates every pipeline's channel groups in one shared
    order; a rank keeps those of its own pipeline. Returns this rank's, by communicator.
    ``timeout`` is the groups' own (give more than the executor's, so that its hang
    monitor names a hang before the backend's watchdog ends the process).
    """
    mine = tuple(dist.get_process_group_ranks(pipeline_group or dist.group.WORLD))
    every: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    channels = [c for c in comms if c.channel]
    if len(channels) != len(comms):
        raise ValueError("make_channel_groups makes two-rank groups for channels only")
    groups = {}
    for pipeline in sorted(set(every)):
        for comm in channels:
            group = dist.new_group([pipeline[r] for r in comm.ranks], timeout=timeout)
            if pipeline == mine:
                groups[comm] = group
    return groups
