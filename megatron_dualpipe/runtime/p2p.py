"""Point-to-point messages of one rank of a lowered schedule.

Semantics (those of :mod:`megatron_dualpipe.schedules.lowering`): a send never blocks the
sender; a receive blocks until its message is there. A message is named by its receive
key ``(RECV_F | RECV_B, stage, micro-batch)`` and travels on a channel
``(sender, receiver, direction)``. A message is a tuple of tensors (its *elements*, e.g.
a stage's hidden state and its attention mask), each sent as one backend message of its own.

Keeping the channels apart (at PP=2 the previous and the next rank are the same rank, and
both directions carry traffic between them):

- every element of every message has its own tag, derived from its key and its index, so
  gloo matches each receive with exactly its send whatever the order;
- backends that ignore tags (NCCL) match messages between two ranks in issue order, so
  forward and backward traffic go through two process groups; within a channel a valid
  schedule receives messages in the order they are sent (the validator checks it), and
  both sides issue a message's elements in index order;
- the sends and receives of a run of adjacent communication actions are issued together:
  where the backend coalesces (NCCL) as one ``batch_isend_irecv`` per group, so that two
  ranks sending to each other at once both progress; on gloo one by one, straight on the
  group. The next run's receives are posted early (``prepost``) so their data can land
  while the rank computes.

Receive buffers take shape and dtype from the :class:`TensorSpec` of each element. With
``variable_shapes`` each element is preceded by its shape (a small int64 message under its
own tag), and the spec gives only the number of dimensions and dtype. Sent tensors must be
contiguous (the executor makes them so).

A sent tensor must stay untouched until its send completes. On CPU (gloo) the work only
knows it is done when waited on, so a helper thread waits on sends in order and drops
each buffer as soon as its send completes; on a device the process group keeps the
buffer alive itself, and the works are waited on at :meth:`PipeComm.finish`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..schedules.ir import Action, Kind, Placement, action_text
from ..schedules.lowering import MessageKey, message_key, peer_of
from .watchdog import PipelineCommError, PipelineWaitError, Watchdog

__all__ = ["MAX_ELEMENTS", "MessageKey", "Payload", "PipeComm", "TensorSpec"]

#: What one message carries: its elements, in order.
Payload = tuple[torch.Tensor, ...]
#: Schedule messages use tags below this; tags from here up are free for other traffic.
TAG_LIMIT = 2**30
#: The most elements one message may have (each needs a tag of its own).
MAX_ELEMENTS = 16


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor a stage receives (its gradient has the same).

    ``device``: where receive buffers go; None means the device of the receiving stage's
    module (the executor resolves it). With variable shapes only ``len(shape)`` is used.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: torch.device | None = None


@dataclass
class _Posted:
    """A posted receive: the sender, one buffer per element and the works to wait on."""

    peer: int
    buffers: list[torch.Tensor]
    works: list[dist.Work | None]


class PipeComm:
    """Sends and receives of pipeline rank ``rank``.

    The schedule must be valid (:func:`~megatron_dualpipe.schedules.validate.validate`):
    then every channel's receives come in the order of its sends, which is what
    backends that match by order need. ``specs`` gives, for each (receive kind, local
    stage) this rank receives, the :class:`TensorSpec` of each element's receive buffer
    with its device resolved. ``group`` carries forward messages (and, on gloo, backward
    ones too); ``backward_group`` (same ranks, same order) carries gradients where the
    backend ignores tags. Pipeline rank ``i`` is rank ``i`` of ``group``.
    """

    def __init__(
        self,
        placement: Placement,
        rank: int,
        specs: Mapping[tuple[Kind, int], tuple[TensorSpec, ...]],
        watchdog: Watchdog,
        *,
        group: dist.ProcessGroup | None = None,
        backward_group: dist.ProcessGroup | None = None,
        variable_shapes: bool = False,
    ):
        for (kind, stage), elements in specs.items():
            if len(elements) > MAX_ELEMENTS:
                raise ValueError(
                    f"stage {stage}'s {kind.value} message has {len(elements)} tensors, more "
                    f"than the {MAX_ELEMENTS} one message may carry: concatenate some of them"
                )
        backend = dist.get_backend(group)
        if backward_group is None and backend != "gloo":
            raise ValueError(
                f"the {dist.get_backend(group)} backend ignores message tags: pass "
                "backward_group (a second process group over the same ranks) so forward "
                "and backward messages between the same two ranks stay apart"
            )
        if 4 * placement.num_stages * placement.num_microbatches * MAX_ELEMENTS > TAG_LIMIT:
            raise ValueError(
                f"{placement.num_stages} stages x {placement.num_microbatches} micro-batches "
                "are too many for distinct message tags: run fewer micro-batches per step"
            )
        self.placement = placement
        self.rank = rank
        self.watchdog = watchdog
        self.variable_shapes = variable_shapes
        forward = group if group is not None else dist.group.WORLD
        self._groups = {"F": forward, "B": forward if backward_group is None else backward_group}
        # gloo runs batched ops one by one anyway: issue them straight on the group.
        self._coalesce = backend != "gloo"
        self._specs = specs
        self.reset()

    def reset(self) -> None:
        """Start a new step (dropping whatever a failed one left)."""
        self._posted: dict[MessageKey, _Posted] = {}
        self._device_sends: list[tuple[dist.Work, str, int]] = []
        self._reaper: _SendReaper | None = None

    # -- tags, buffers, ops --------------------------------------------------------------
    def _tag(self, key: MessageKey, element: int, shape: bool = False) -> int:
        kind, stage, mb = key
        p = self.placement
        direction = 0 if kind is Kind.RECV_F else 1
        message = (direction * p.num_stages + stage) * p.num_microbatches + mb
        return ((message * MAX_ELEMENTS + element) << 1) | shape

    def _group(self, key: MessageKey) -> dist.ProcessGroup:
        return self._groups["F" if key[0] is Kind.RECV_F else "B"]

    def _op(
        self,
        send: bool,
        key: MessageKey,
        element: int,
        peer: int,
        tensor: torch.Tensor,
        shape: bool = False,
    ) -> _Op:
        return _Op(send, tensor, self._group(key), peer, self._tag(key, element, shape))

    def _start(self, ops: list[_Op]) -> list[dist.Work]:
        """Issue ``ops``: on coalescing backends as one ``batch_isend_irecv`` per group
        (the ops of a batch share its work), else one by one; each op's work in order."""
        if not self._coalesce:
            return [
                (op.group.send if op.send else op.group.recv)([op.tensor], op.peer, op.tag)
                for op in ops
            ]
        works: list[dist.Work | None] = [None] * len(ops)
        by_group: dict[int, list[int]] = {}
        for i, op in enumerate(ops):
            by_group.setdefault(id(op.group), []).append(i)
        for indices in by_group.values():
            batch = [ops[i].p2p() for i in indices]
            done = dist.batch_isend_irecv(batch)
            for j, i in enumerate(indices):
                works[i] = done[j] if len(done) == len(indices) else done[-1]
        return works  # type: ignore[return-value]

    @staticmethod
    def _buffer(spec: TensorSpec, shape: Sequence[int] | None = None) -> torch.Tensor:
        size = spec.shape if shape is None else tuple(shape)
        return torch.empty(size, dtype=spec.dtype, device=spec.device)

    # -- issuing ----------------------------------------------------------------------
    def _send_ops(
        self, sends: Sequence[tuple[Action, Payload]]
    ) -> tuple[list[_Op], list[tuple[str, int, torch.Tensor]]]:
        """The ops of ``sends``, element by element (with variable shapes, each shape
        first) and, per op, the name, peer and tensor it belongs to."""
        ops, owners = [], []
        for action, payload in sends:
            key = message_key(action, self.placement)
            peer = peer_of(action, self.placement)
            for element, tensor in enumerate(payload):
                what = _element_name(str(action), element, len(payload))
                if self.variable_shapes:
                    shape = torch.tensor(tensor.shape, dtype=torch.int64, device=tensor.device)
                    ops.append(self._op(True, key, element, peer, shape, shape=True))
                    owners.append((what, peer, shape))
                ops.append(self._op(True, key, element, peer, tensor))
                owners.append((what, peer, tensor))
        return ops, owners

    def _receive_ops(
        self, receives: Sequence[Action]
    ) -> tuple[list[_Op], list[tuple[MessageKey, int]]]:
        """Buffers and ops for the receives not posted yet (fixed shapes), registered as
        posted; per op its (key, element), whose work is filled in once started."""
        ops, slots = [], []
        for action in receives:
            key = message_key(action, self.placement)
            if key in self._posted:
                continue
            peer = peer_of(action, self.placement)
            buffers = [self._buffer(spec) for spec in self._specs[key[:2]]]
            self._posted[key] = _Posted(peer, buffers, [None] * len(buffers))
            for element, buffer in enumerate(buffers):
                ops.append(self._op(False, key, element, peer, buffer))
                slots.append((key, element))
        return ops, slots

    def _issue(self, sends: Sequence[tuple[Action, Payload]], receives: Sequence[Action]) -> None:
        """Start ``sends`` and the fixed-shape ``receives`` together: on coalescing
        backends one batch, so two ranks sending to each other at once both progress."""
        send_ops, owners = self._send_ops(sends)
        receive_ops, slots = ([], []) if self.variable_shapes else self._receive_ops(receives)
        ops = send_ops + receive_ops
        if not ops:
            return
        names = dict.fromkeys([str(a) for a, _ in sends] + [action_text(*k) for k, _ in slots])
        with self.watchdog.guard(", ".join(names), ops[0].peer):
            works = self._start(ops)
        for (key, element), work in zip(slots, works[len(send_ops) :], strict=True):
            self._posted[key].works[element] = work
        for work, (what, peer, tensor) in zip(works[: len(send_ops)], owners, strict=True):
            if tensor.device.type == "cpu":
                if self._reaper is None:
                    self._reaper = _SendReaper(self.watchdog)
                self._reaper.add(work, tensor, what, peer)
            else:
                self._device_sends.append((work, what, peer))

    def _post_variable(self, receives: Sequence[Action]) -> None:
        """Variable shapes: per element, receive its shape, then post its data; one at a
        time, so issue order matches the sender's where tags are ignored."""
        for action in receives:
            key = message_key(action, self.placement)
            peer = peer_of(action, self.placement)
            specs = self._specs[key[:2]]
            posted = self._posted[key] = _Posted(peer, [], [])
            for element, spec in enumerate(specs):
                what = _element_name(action_text(*key), element, len(specs))
                shape = torch.empty(len(spec.shape), dtype=torch.int64, device=spec.device)
                (work,) = self._start([self._op(False, key, element, peer, shape, shape=True)])
                self.watchdog.wait(work, f"the shape of {what}", peer)
                buffer = self._buffer(spec, shape.tolist())
                (work,) = self._start([self._op(False, key, element, peer, buffer)])
                posted.buffers.append(buffer)
                posted.works.append(work)

    # -- the public steps ---------------------------------------------------------------
    def exchange(
        self, sends: Sequence[tuple[Action, Payload]], receives: Sequence[Action]
    ) -> list[Payload]:
        """One run of adjacent communication actions: start ``sends`` (contiguous
        tensors; they complete in the background) and ``receives`` (unless pre-posted),
        wait for the receives and return their payloads."""
        self.check()
        self._issue(sends, receives)
        if self.variable_shapes:
            self._post_variable(receives)
        payloads = []
        for action in receives:
            key = message_key(action, self.placement)
            posted = self._posted.pop(key)
            for element, work in enumerate(posted.works):
                what = _element_name(action_text(*key), element, len(posted.works))
                self.watchdog.wait(work, what, posted.peer)
            payloads.append(tuple(posted.buffers))
        return payloads

    def prepost(self, receives: Sequence[Action]) -> None:
        """Post ``receives`` ahead of need so their data can land during compute (with
        variable shapes this does nothing: posting needs the shape)."""
        self._issue((), receives)

    def check(self) -> None:
        """Raise the error of a send that failed in the background, if any."""
        if self._reaper is not None:
            self._reaper.check()

    def finish(self) -> None:
        """Wait until every send has completed; every posted receive must be consumed."""
        if self._posted:
            names = sorted(action_text(*key) for key in self._posted)
            raise RuntimeError(f"receives posted but never consumed: {names}")
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.close()
        sends, self._device_sends = self._device_sends, []
        for work, what, peer in sends:
            self.watchdog.wait(work, what, peer)


@dataclass(frozen=True, slots=True)
class _Op:
    """One send or receive, before it is issued."""

    send: bool
    tensor: torch.Tensor
    group: dist.ProcessGroup
    peer: int  # rank in ``group``
    tag: int

    def p2p(self) -> dist.P2POp:
        op = dist.isend if self.send else dist.irecv
        return dist.P2POp(op, self.tensor, group=self.group, tag=self.tag, group_peer=self.peer)


def _element_name(message: str, element: int, elements: int) -> str:
    """``message`` itself when it has one element, else ``message[element]``."""
    return message if elements == 1 else f"{message}[{element}]"


class _SendReaper:
    """Waits on CPU sends in a helper thread and drops each buffer once it is sent."""

    def __init__(self, watchdog: Watchdog):
        self._watchdog = watchdog
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: PipelineCommError | None = None
        self._waiting_on = ("", -1)
        self._thread = threading.Thread(target=self._loop, name="pipeline-sends", daemon=True)
        self._thread.start()

    def add(self, work: dist.Work, tensor: torch.Tensor, what: str, peer: int) -> None:
        self._queue.put((work, tensor, what, peer))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            work, tensor, what, peer = item
            del item
            self._waiting_on = (what, peer)
            try:
                self._watchdog.wait(work, what, peer, bounded=False)
            except PipelineCommError as error:
                self._error = error
                return
            del work, tensor

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Return once every queued send has completed (within the watchdog's timeout)."""
        self._queue.put(None)
        self._thread.join(self._watchdog.timeout_s)
        self.check()
        if self._thread.is_alive():
            what, peer = self._waiting_on
            raise PipelineWaitError(
                self._watchdog.rank,
                f"{what} to be received",
                peer,
                self._watchdog.timeout_s,
                "the peer never received it",
            )
