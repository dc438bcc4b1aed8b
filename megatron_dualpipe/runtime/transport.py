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
    the pipeline ranks' global ranks (pipeline rank ``i`` is ``ranks[i]``)."""

    def __init__(
        self,
        groups: dist.ProcessGroup | Mapping[Comm, dist.ProcessGroup],
        ranks: Sequence[int],
    ):
        self._one = groups if isinstance(groups, dist.ProcessGroup) else None
        self._groups = {} if self._one is not None else dict(groups)
        first = self._one if self._one is not None else next(iter(self._groups.values()), None)
        backend = dist.get_backend(first) if first is not None else "gloo"
        if self._one is not None and backend != "gloo":
            raise ValueError(
                f"the {backend} backend ignores message tags: give each communicator of "
                "the plan its own group (make_channel_groups)"
            )
        self._gloo = backend == "gloo"
        self.host_waits = "timed" if self._gloo else "stream"
        self._ranks = list(ranks)

    def group(self, comm: Comm) -> dist.ProcessGroup:
        if self._one is not None:
            return self._one
        try:
            return self._groups[comm]
        except KeyError:
            raise ValueError(f"no process group for communicator {comm}") from None

    def _peer(self, comm: Comm, pipeline_rank: int) -> int:
        """``pipeline_rank``'s rank in ``comm``'s group."""
        return dist.get_group_rank(self.group(comm), self._ranks[pipeline_rank])

    def setup(self, comm: Comm, rank: int, watchdog: Watchdog) -> None:
        """Set a channel's communicator up and connect its two ranks: one small message
        from sender to receiver, waited on (NCCL creates communicators and connections
        on first use, blocking each member until the other arrives)."""
        if self._one is not None:
            return
        group = self.group(comm)
        device = torch.device("cuda", torch.cuda.current_device()) if not self._gloo else None
        probe = torch.zeros(1, device=device)
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
        if self._gloo:
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
        groups = [self._one] if self._one is not None else list(self._groups.values())
        for group in dict.fromkeys(groups):
            group.abort()

    def close(self) -> None:
        """Nothing to release: the groups belong to whoever made them."""


def make_channel_groups(
    comms: Sequence[Comm], pipeline_group: dist.ProcessGroup | None = None
) -> dict[Comm, dist.ProcessGroup]:
    """A two-rank process group per communicator in ``comms`` (channels over pipeline
    ranks of ``pipeline_group``), for every pipeline of the world.

    Collective over the whole world, as creating groups is: every rank learns every
    pipeline group's ranks and creates every pipeline's channel groups in one shared
    order; a rank keeps those of its own pipeline. Returns this rank's, by communicator.
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
            group = dist.new_group([pipeline[r] for r in comm.ranks])
            if pipeline == mine:
                groups[comm] = group
    return groups
