"""Point-to-point messages of one rank, as its communication plan says.

:class:`PipeComm` carries out a rank's ``Issue`` and ``Wait`` steps of a
:class:`~megatron_dualpipe.schedules.comm_plan.CommPlan` through a
:class:`~.transport.Transport`, and nothing else: what is sent and received, on which
communicator, in which batch and when the rank waits all come from the plan. A message is
a tuple of tensors, one backend operation each; receive buffers follow each element's
:class:`TensorSpec`. Sent tensors are released once their send is known complete
(``peak_sends``). Tags, shapes and hang watching: docs/runtime.md, "Communication".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..schedules.comm_plan import Comm, Issue, PlanKey, Wait, key_text
from ..schedules.ir import Kind, Placement
from ..schedules.lowering import MessageKey
from .transport import TAG_LIMIT, ElementOp, Handle, Transport
from .watchdog import HangMonitor, PipelineCommError, Watchdog

__all__ = ["MAX_ELEMENTS", "TAG_LIMIT", "MessageKey", "Payload", "PipeComm", "TensorSpec"]

#: What one message carries: its elements, in order.
Payload = tuple[torch.Tensor, ...]
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


def message_tag(placement: Placement, key: PlanKey, element: int) -> int:
    """The tag of one element of a message (of its shape message where ``key`` ends in
    ``"shape"``): even, so a transport may use the odd tag above it for its own signal."""
    kind, stage, mb = key[:3]
    direction = 0 if kind is Kind.RECV_F else 1
    message = (direction * placement.num_stages + stage) * placement.num_microbatches + mb
    return ((message * MAX_ELEMENTS + element) * 2 + (len(key) > 3)) * 2


@dataclass
class _Posted:
    """An issued receive: the sender, one buffer per element, the works to wait on."""

    peer: int
    comm: Comm
    buffers: list[torch.Tensor]
    works: list[Handle] = field(default_factory=list)


@dataclass
class _Sent:
    """A send in flight: what it is, to whom, its works and the tensors they read."""

    what: str
    peer: int
    works: list[Handle]
    tensors: list[torch.Tensor]


class PipeComm:
    """Sends and receives of pipeline rank ``rank`` through ``transport``.

    ``specs`` gives, for each (receive kind, local stage) this rank receives, the
    :class:`TensorSpec` of each element's receive buffer with its device resolved.
    ``watch_paused``: the hang monitor's ``paused`` (:class:`~.watchdog.HangMonitor`).
    """

    def __init__(
        self,
        placement: Placement,
        rank: int,
        specs: Mapping[tuple[Kind, int], tuple[TensorSpec, ...]],
        watchdog: Watchdog,
        transport: Transport,
        *,
        variable_shapes: bool = False,
        graph_safe: bool = False,
        watch_paused: Callable[[], bool] | None = None,
    ):
        for (kind, stage), elements in specs.items():
            if len(elements) > MAX_ELEMENTS:
                raise ValueError(
                    f"stage {stage}'s {kind.value} message has {len(elements)} tensors, more "
                    f"than the {MAX_ELEMENTS} one message may carry: concatenate some of them"
                )
        if 8 * placement.num_stages * placement.num_microbatches * MAX_ELEMENTS > TAG_LIMIT:
            raise ValueError(
                f"{placement.num_stages} stages x {placement.num_microbatches} micro-batches "
                "are too many for distinct message tags: run fewer micro-batches per step"
            )
        self.placement = placement
        self.rank = rank
        self.watchdog = watchdog
        self.transport = transport
        self.variable_shapes = variable_shapes
        self._specs = specs
        #: No host synchronisation in a step (a CUDA graph can capture it): every wait is a
        #: plain ``work.wait()`` (on NCCL, the compute stream waits), no deadline on the
        #: host, no hang monitor polling ``is_completed()``.
        self.graph_safe = graph_safe
        self._monitor = (
            HangMonitor(watchdog, transport.abort, paused=watch_paused)
            if transport.host_waits == "stream" and not graph_safe
            else None
        )
        self._set_up = False
        self._names: dict[PlanKey, str] = {}  # message texts, made once: messages recur
        self._tags: dict[PlanKey, int] = {}
        self.reset()

    def _name(self, key: PlanKey) -> str:
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = key_text(key)
        return name

    def _tag(self, key: PlanKey) -> int:
        tag = self._tags.get(key)
        if tag is None:
            tag = self._tags[key] = message_tag(self.placement, key, 0)
        return tag

    def reset(self) -> None:
        """Start a new step (dropping whatever a failed one left)."""
        self._posted: dict[PlanKey, _Posted] = {}
        self._shapes: dict[MessageKey, list[list[int]]] = {}
        self._sent: dict[PlanKey, _Sent] = {}
        self._released: set[PlanKey] = set()  # sends seen complete, tensors dropped
        self.peak_sends = 0

    def setup(self, comms: Sequence[tuple[Comm, Sequence[int]]]) -> None:
        """Set up ``comms`` (this rank's, in the plan's shared order, each with the peers
        this rank talks to on it), once."""
        if not self._set_up:
            for comm, peers in comms:
                self.transport.setup(comm, self.rank, peers, self.watchdog)
            self._set_up = True

    # -- issuing ----------------------------------------------------------------------
    def _receive_buffers(self, key: PlanKey) -> list[torch.Tensor]:
        specs = self._specs[key[:2]]
        device = specs[0].device
        if len(key) > 3:  # every element's shape, one int64 message
            size = sum(len(spec.shape) for spec in specs)
            return [torch.empty(size, dtype=torch.int64, device=device)]
        shapes = self._shapes.pop(key) if self.variable_shapes else [s.shape for s in specs]
        return [
            torch.empty(tuple(shape), dtype=spec.dtype, device=spec.device)
            for spec, shape in zip(specs, shapes, strict=True)
        ]

    def issue(self, step: Issue, payloads: Mapping[MessageKey, Payload]) -> None:
        """Hand ``step``'s batch to the transport: sends take their (contiguous) tensors
        from ``payloads``, receives get fresh buffers; nobody waits here."""
        self.check()
        self._release()
        ops: list[ElementOp] = []
        elements: dict[PlanKey, int] = {}
        for op in step.ops:
            if op.kind == "send":
                payload = payloads[op.key[:3]]
                if len(op.key) > 3:
                    dims = [d for t in payload for d in t.shape]
                    device = payload[0].device
                    tensors = [torch.tensor(dims, dtype=torch.int64, device=device)]
                else:
                    tensors = list(payload)
            else:
                tensors = self._receive_buffers(op.key)
                self._posted[op.key] = _Posted(op.peer, op.comm, tensors)
            tag = self._tag(op.key)
            ops += [ElementOp(op, i, t, tag + 4 * i) for i, t in enumerate(tensors)]
            elements[op.key] = len(tensors)
        if not ops:
            return
        names = ", ".join(self._name(key) for key in elements)
        with self.watchdog.guard(names, step.ops[0].peer):
            handles = self.transport.start(step.comm, ops)
        for element, work in zip(ops, handles, strict=True):
            op = element.op
            what = _element_name(self._name(op.key), element.element, elements[op.key])
            if self._monitor is not None:
                self._monitor.watch(work, what, op.peer)
            if op.kind == "recv":
                self._posted[op.key].works.append(work)
                continue
            sent = self._sent.get(op.key)
            if sent is None:
                sent = self._sent[op.key] = _Sent(self._name(op.key), op.peer, [], [])
            sent.works.append(work)
            sent.tensors.append(element.tensor)
        self.peak_sends = max(self.peak_sends, len(self._sent))

    # -- waiting ----------------------------------------------------------------------
    def _wait(self, work: Handle, what: str, peer: int) -> None:
        """Wait for one receive: with the watchdog's deadline on the host (gloo), else
        without one, the hang monitor watching (NCCL: the host does not block)."""
        if self.graph_safe:
            with self.watchdog.guard(what, peer, bounded=False):
                work.wait()
            return
        if self._monitor is None:
            self.watchdog.wait(work, what, peer)
            return
        self._monitor.waiting(work)
        try:
            with self.watchdog.guard(what, peer):
                work.wait()
        except PipelineCommError as error:
            if self._monitor.error is not None:
                raise self._monitor.error from error
            raise

    def wait(self, step: Wait) -> dict[MessageKey, Payload]:
        """Block until ``step``'s messages completed; return the payloads received."""
        self.check()
        received = {}
        sends = []
        for key in step.keys:
            posted = self._posted.pop(key, None)
            if posted is None:
                sends.append(key)
                continue
            for element, work in enumerate(posted.works):
                what = _element_name(self._name(key), element, len(posted.works))
                self._wait(work, what, posted.peer)
            if len(key) > 3:
                self._shapes[key[:3]] = self._split_shapes(key, posted.buffers[0])
            else:
                received[key] = tuple(posted.buffers)
        if sends:
            self._wait_sends(sends)
        self._release()
        return received

    def _split_shapes(self, key: PlanKey, dims: torch.Tensor) -> list[list[int]]:
        values = dims.tolist()
        shapes, at = [], 0
        for spec in self._specs[key[:2]]:
            shapes.append(values[at : at + len(spec.shape)])
            at += len(spec.shape)
        return shapes

    def _wait_sends(self, keys: Sequence[PlanKey]) -> None:
        """Wait until the sends ``keys`` completed, then release their tensors."""
        for key in keys:
            sent = self._sent.pop(key, None)
            if sent is None:
                if key in self._released:
                    self._released.discard(key)
                    continue
                raise RuntimeError(f"rank {self.rank} waits for {key_text(key)}, never issued")
            for work in sent.works:
                self._wait(work, sent.what, sent.peer)

    def _release(self) -> None:
        """Drop the tensors of every send known to be complete (a non-blocking poll; none
        when graph-safe: the plan's waits release them)."""
        if not self._sent or self.graph_safe:
            return
        for key in [k for k, s in self._sent.items() if all(w.is_completed() for w in s.works)]:
            sent = self._sent.pop(key)
            self._released.add(key)
            if self._monitor is not None:
                for work in sent.works:
                    work.wait()  # on NCCL: orders the compute stream after it, at no cost

    def check(self) -> None:
        """Raise the error of an operation that failed in the background, if any."""
        if self._monitor is not None:
            self._monitor.check()

    def finish(self) -> None:
        """End the step: every issued message must have been waited on by the plan."""
        left = sorted(map(key_text, [*self._posted, *self._sent, *self._released]))
        if left:
            raise RuntimeError(f"rank {self.rank} ended the step with messages in flight: {left}")

    def close(self) -> None:
        """Stop the helper threads (the executor is not used again)."""
        if self._monitor is not None:
            self._monitor.close()
        self.transport.close()


def _element_name(message: str, element: int, elements: int) -> str:
    """``message`` itself when it has one element, else ``message[element]``."""
    return message if elements == 1 else f"{message}[{element}]"
