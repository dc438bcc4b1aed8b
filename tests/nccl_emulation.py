"""Test scaffolding: a gloo transport that obeys NCCL's ordering rules, so CPU tests see
what NCCL would do.

Gloo buffers sends and matches by tag, so a plan that would deadlock on NCCL runs on it.
:class:`NcclRulesTransport` takes that away (the rules are those modelled in
:mod:`megatron_dualpipe.schedules.nccl_rules`):

- each stream of a rank is a worker thread that runs its batches in issue order, one at a
  time, each until all its operations completed; with ``streams="shared"`` (the default:
  the worst case, as PyTorch may give all of a rank's communicators one stream) a rank
  has one such thread for all its communicators, with ``"distinct"`` one per
  communicator;
- a send completes only after the peer's matching receive has started (rendezvous, what
  NCCL does for messages above its buffer size): the receiving stream, when its receive
  starts, sends the sender a small ready signal, and the sending stream waits for it
  before it sends the data;
- waits do not time out on the host (``host_waits = "stream"``): the executor's hang
  monitor watches every operation and, past its timeout, aborts the transport, which
  fails every pending operation.

The data itself still travels over one gloo group with the executor's tags (the ready
signal uses the odd tag above its message's). Tests pass it to
:class:`~megatron_dualpipe.runtime.PipelineExecutor` as its ``transport``
(:func:`on_the_world`); on GPUs the executor's default,
:class:`~megatron_dualpipe.runtime.transport.GroupTransport` over NCCL, runs.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Hashable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dualpipe.runtime.transport import ElementOp, Handle
from megatron_dualpipe.runtime.watchdog import Watchdog
from megatron_dualpipe.schedules.comm_plan import Comm

__all__ = ["NcclRulesTransport", "on_the_world"]


class _Work:
    """An emulated operation: complete once its batch has completed."""

    def __init__(self, aborted: threading.Event) -> None:
        self._aborted = aborted
        self._done = threading.Event()
        self._error: str | None = None

    def finish(self, error: str | None = None) -> None:
        """Its batch has completed, or failed with ``error``."""
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        """Whether its batch has completed (or failed), without blocking."""
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until complete (the host must: on CPU there is no stream to wait)."""
        while not self._done.wait(0.02):
            if self._aborted.is_set():
                raise RuntimeError("the pipeline's communicators were aborted")
        if self._error is not None:
            raise RuntimeError(self._error)
        return True


class _Stream(threading.Thread):
    """One stream of this rank: its batches, one after the other."""

    def __init__(self, transport: NcclRulesTransport, label: str) -> None:
        super().__init__(name=f"nccl-rules-{label}", daemon=True)
        self._transport = transport
        self.batches: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while (batch := self.batches.get()) is not None:
            ops, works = batch
            try:
                self._run_batch(ops)
            except RuntimeError as error:
                for work in works:
                    work.finish(str(error).strip().splitlines()[0] if str(error) else repr(error))
                self._transport.fail(str(error))
                return
            for work in works:
                work.finish()

    def _run_batch(self, ops: Sequence[ElementOp]) -> None:
        group, peer_of = self._transport.group, self._transport.group_rank
        started = []
        waiting = []
        for op in ops:
            peer = peer_of(op.op.peer)
            if op.op.kind == "recv":
                started.append(group.recv([op.tensor], peer, op.tag))
                started.append(group.send([torch.ones(1)], peer, op.tag + 1))  # ready
            else:
                ready = torch.empty(1)
                waiting.append((op, peer, ready, group.recv([ready], peer, op.tag + 1)))
        for op, peer, _, ready in waiting:  # each send once its receive has started
            ready.wait()
            started.append(group.send([op.tensor], peer, op.tag))
        for work in started:
            work.wait()


#: How the emulation puts a rank's communicators on streams.
STREAMS = ("shared", "distinct")


class NcclRulesTransport:
    """The plan's communicators emulated over ``group`` (gloo) under NCCL's rules, on
    ``streams`` (``"shared"`` or ``"distinct"``); ``ranks`` are the pipeline ranks' global
    ranks. For CPU tests (see the module)."""

    host_waits = "stream"

    def __init__(
        self, group: dist.ProcessGroup, ranks: Sequence[int], *, streams: str = "shared"
    ) -> None:
        if dist.get_backend(group) != "gloo":
            raise ValueError("the NCCL-rules emulation runs over a gloo group")
        if streams not in STREAMS:
            raise ValueError(f"unknown streams {streams!r}: use one of {', '.join(STREAMS)}")
        self.group = group
        self.streams = streams
        self._ranks = list(ranks)
        self._streams: dict[Hashable, _Stream] = {}
        self._aborted = threading.Event()
        self.error: str | None = None

    def group_rank(self, pipeline_rank: int) -> int:
        """The rank in :attr:`group` of pipeline rank ``pipeline_rank``."""
        return dist.get_group_rank(self.group, self._ranks[pipeline_rank])

    def setup(self, comm: Comm, rank: int, peers: Sequence[int], watchdog: Watchdog) -> None:
        """Nothing to set up: NCCL's set-up rule is checked by the plan's model."""

    def start(self, comm: Comm, ops: Sequence[ElementOp]) -> list[Handle]:
        """Queue one batch on ``comm``'s stream; one handle per operation, complete once the
        whole batch has completed. Refused once aborted."""
        if self._aborted.is_set():
            raise RuntimeError("the pipeline's communicators were aborted")
        works = [_Work(self._aborted) for _ in ops]
        label = "shared" if self.streams == "shared" else comm
        stream = self._streams.get(label)
        if stream is None:
            stream = self._streams[label] = _Stream(self, str(label))
        stream.batches.put((list(ops), works))
        return works

    def fail(self, error: str) -> None:
        """A stream's backend operation failed: keep the first error."""
        if self.error is None:
            self.error = error

    def abort(self) -> None:
        """Fail every pending and later operation (the hang monitor's timeout)."""
        self._aborted.set()

    def close(self) -> None:
        """Stop the streams once their queued batches have run."""
        for stream in self._streams.values():
            stream.batches.put(None)
        self._streams.clear()


def on_the_world() -> NcclRulesTransport:
    """The emulation over the default (gloo) group, its ranks the pipeline's in order, all
    of a rank's communicators on one stream: call it on each rank after the group is made."""
    world = dist.group.WORLD
    return NcclRulesTransport(world, dist.get_process_group_ranks(world))
