"""How the batches of a communication plan reach a torch.distributed backend.

A :class:`Transport` takes one :class:`~megatron_dualpipe.schedules.comm_plan.Issue` at a
time, as element operations, and returns one handle per operation (``wait()``,
``is_completed()``); :attr:`Transport.host_waits` (``"timed"`` or ``"stream"``) says how
the executor waits on them. :class:`GroupTransport` runs the plan's one communicator on the
pipeline group it is given, each batch one ``batch_isend_irecv``; only its waits differ by
device. Why, and the tags: docs/runtime.md, "Communication".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from ..schedules.comm_plan import Comm, CommOp
from .watchdog import Watchdog

__all__ = [
    "SETUP_TAG",
    "TAG_LIMIT",
    "ElementOp",
    "GroupTransport",
    "Handle",
    "Transport",
]

#: Schedule messages use tags below this; tags from here up are free for other traffic.
TAG_LIMIT = 2**30
#: The set-up probes' tag: above every schedule message's, beside the mirror exchange's.
SETUP_TAG = TAG_LIMIT + 2


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
    """Hands a plan's batches to a backend (docs/runtime.md, "Communication")."""

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
    """The plan's batches on process group ``group``, the pipeline group: pipeline rank
    ``i`` is global rank ``ranks[i]``. ``device`` is where the messages' tensors live (the
    backend's: CPU for gloo, CUDA for NCCL); it decides how handles are waited on
    (:attr:`host_waits`) and nothing else. Each batch is one ``batch_isend_irecv`` with
    each element's tag; the plan must use one communicator (tags aside, NCCL matches the
    messages between two ranks in issue order)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        ranks: Sequence[int],
        *,
        device: torch.device | None = None,
    ):
        self.group = group
        self.device = device or torch.device("cpu")
        self.host_waits = "timed" if self.device.type == "cpu" else "stream"
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
        """Connect ``rank`` to its ``peers`` on ``comm``: one small message each way in one
        batch, waited on (NCCL creates communicators and connections on first use,
        blocking each member until the others arrive). Refuses a second communicator."""
        if self._comm is not None and comm != self._comm:
            raise ValueError(
                f"the plan uses communicators {self._comm} and {comm} but a pipeline group "
                "carries one (NCCL ignores tags): run the lock-step plan"
            )
        self._comm = comm
        order = [peer for peer in sorted(peers) for _ in range(2)]  # a send, a receive each
        probes = [
            dist.P2POp(
                dist.isend if i % 2 == 0 else dist.irecv,
                torch.zeros(1, device=self.device),
                group=self.group,
                tag=SETUP_TAG,
                group_peer=self._peer(peer),
            )
            for i, peer in enumerate(order)
        ]
        if probes:
            # A coalesced batch returns one work: it stands for every probe.
            for work, peer in zip(dist.batch_isend_irecv(probes), order, strict=False):
                watchdog.wait(work, f"the set-up of communicator {comm}", peer)

    def start(self, comm: Comm, ops: Sequence[ElementOp]) -> list[Handle]:
        batch = [
            dist.P2POp(
                dist.isend if op.op.kind == "send" else dist.irecv,
                op.tensor,
                group=self.group,
                tag=op.tag,
                group_peer=self._peer(op.op.peer),
            )
            for op in ops
        ]
        works = dist.batch_isend_irecv(batch)
        # A coalesced batch (NCCL) may return one work for all its ops.
        return works if len(works) == len(ops) else [works[-1]] * len(ops)

    def abort(self) -> None:
        """Abort the group: every pending operation fails (NCCL; gloo's waits are bounded
        on the host instead)."""
        self.group.abort()

    def close(self) -> None:
        """Nothing to release: the group belongs to whoever made it."""
