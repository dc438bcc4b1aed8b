"""A model of NCCL's ordering rules, run over a communication plan.

:func:`check_nccl` runs a plan as PyTorch's ``ProcessGroupNCCL`` over NCCL would: each
communicator's batches in issue order on a stream drawn from a pool, so that several may
share one (``streams``: ``"shared"``, the default and worst case, ``"distinct"``, or a
mapping of (rank, communicator) to a stream label), messages matched in issue order, sends
above ``eager_limit`` held until their receive runs, the step's collectives of other groups
(:mod:`.step_collectives`) on each rank's stream. It raises :class:`CommDeadlockError`
naming the cycle where the plan cannot finish, and :class:`ScheduleError` where two ranks
would match different messages. :func:`inflight_bound` is the most sends a rank can have
in flight at any of its steps, for any timing. The rules, and what the model assumes:
docs/runtime.md, "Communication on NCCL".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .comm_plan import Comm, CommOp, CommPlan, Init, Issue, PlanKey, Wait, key_text
from .ir import ScheduleError
from .step_collectives import COLLECTIVES, with_collectives

__all__ = [
    "EAGER_LIMIT",
    "STREAMS",
    "CommDeadlockError",
    "NcclReport",
    "Streams",
    "check_nccl",
    "inflight_bound",
]

#: NCCL's default buffer (``NCCL_BUFFSIZE``, 4 MiB): larger sends wait for their receive.
EAGER_LIMIT = 4 * 2**20
#: The named stream assignments: every communicator of a rank on one stream, or one each.
STREAMS = ("shared", "distinct")
#: Which communicators of each rank share a stream (docs/runtime.md, "Communication on NCCL").
Streams = str | Mapping[tuple[int, Comm], Hashable]


class CommDeadlockError(ScheduleError):
    """The plan cannot finish under NCCL's rules; the message names the cycle."""

    def __init__(self, message: str, ranks: list[int], comms: list[Comm], keys: list[PlanKey]):
        super().__init__(message)
        self.ranks = ranks
        self.comms = comms
        self.keys = keys


@dataclass(frozen=True)
class NcclReport:
    """A plan that finishes under NCCL's rules: its communicators (all, and per rank)
    and the most sends each rank can have in flight."""

    comms: list[Comm]
    comms_per_rank: list[int]
    inflight_bound: list[int]


class _Op:
    """An issued operation: its plan op, rank, batch, place in its pair's order."""

    __slots__ = ("batch", "done", "index", "op", "partner", "rank")

    def __init__(self, op: CommOp, rank: int, batch: _Batch, index: int):
        self.op = op
        self.rank = rank
        self.batch = batch
        self.index = index
        self.done = False
        self.partner: _Op | None = None

    def text(self) -> str:
        if self.op.kind == "collective":
            return f"rank {self.rank}'s {key_text(self.op.key)}"
        verb, way = ("send", "to") if self.op.kind == "send" else ("receive", "from")
        return f"rank {self.rank}'s {verb} of {key_text(self.op.key)} {way} rank {self.op.peer}"


class _Batch:
    __slots__ = ("left", "ops", "stream")

    def __init__(self, stream: tuple[int, Hashable]):
        self.ops: list[_Op] = []
        self.stream = stream
        self.left = 0  # operations not complete yet

    @property
    def done(self) -> bool:
        return not self.left


def _complete(op: _Op) -> None:
    if not op.done:
        op.done = True
        op.batch.left -= 1


def _stream_label(streams: Streams) -> Callable[[int, Comm], Hashable]:
    """The stream of each (rank, communicator) under ``streams``."""
    if streams == "shared":
        return lambda rank, comm: "shared"
    if streams == "distinct":
        return lambda rank, comm: comm
    if isinstance(streams, str):
        raise ScheduleError(f"unknown streams {streams!r}: use one of {', '.join(STREAMS)}")
    return lambda rank, comm: streams.get((rank, comm), comm)


T = TypeVar("T")


class _Pending(Generic[T]):
    """A first-in first-out queue that holds each item once: an item already waiting is
    looked at after whatever woke it again, so a second entry would find nothing new."""

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._order: deque[T] = deque()
        self._held: set[T] = set()
        self.extend(items)

    def __bool__(self) -> bool:
        return bool(self._order)

    def append(self, item: T) -> None:
        if item not in self._held:
            self._held.add(item)
            self._order.append(item)

    def extend(self, items: Iterable[T]) -> None:
        for item in items:
            self.append(item)

    def popleft(self) -> T:
        item = self._order.popleft()
        self._held.discard(item)
        return item


class _Model:
    """The state of one run of the rules over a plan."""

    def __init__(self, plan: CommPlan, eager_limit: int, streams: Streams):
        self.plan = plan
        self.eager_limit = eager_limit
        self.stream_of = _stream_label(streams)
        n = len(plan.ranks)
        self.pc = [0] * n
        self.streams: dict[tuple[int, Hashable], deque[_Batch]] = {}
        self.sends: dict[tuple[Comm, int, int], list[_Op]] = {}
        self.recvs: dict[tuple[Comm, int, int], list[_Op]] = {}
        self.by_key: list[dict[PlanKey, _Op]] = [{} for _ in range(n)]
        self.ready: set[Comm] = set()
        self.arrived: dict[Comm, set[int]] = {}
        self.eager_comms = {s.comm for steps in plan.ranks for s in steps if isinstance(s, Init)}
        self.touched: _Pending[tuple[int, Hashable]] = _Pending()  # streams that may progress
        self.woken: _Pending[int] = _Pending(range(n))  # hosts that may go on

    # -- hosts -----------------------------------------------------------------------
    def _setup(self, rank: int, comm: Comm) -> bool:
        """Arrive at ``comm``'s set-up; whether it is done."""
        if comm in self.ready:
            return True
        arrived = self.arrived.setdefault(comm, set())
        arrived.add(rank)
        if arrived >= set(comm.ranks):
            self.ready.add(comm)
            self.woken.extend(comm.ranks)
            return True
        return False

    def advance(self, rank: int) -> bool:
        """Run rank ``rank``'s host as far as it can go; whether it moved."""
        steps = self.plan.ranks[rank]
        moved = False
        while self.pc[rank] < len(steps):
            step = steps[self.pc[rank]]
            if isinstance(step, Init):
                if not self._setup(rank, step.comm):
                    break
            elif isinstance(step, Issue):
                if step.comm not in self.eager_comms and not self._setup(rank, step.comm):
                    break
                self._issue(rank, step)
            elif isinstance(step, Wait):
                mine = self.by_key[rank]
                unknown = [k for k in step.keys if k not in mine]
                if unknown:
                    raise ScheduleError(
                        f"rank {rank} waits for {key_text(unknown[0])}, which it never issued"
                    )
                if any(mine[k].batch.left for k in step.keys):
                    break
            self.pc[rank] += 1
            moved = True
        return moved

    def _issue(self, rank: int, step: Issue) -> None:
        where = (rank, self.stream_of(rank, step.comm))
        batch = _Batch(where)
        for op in step.ops:
            if op.comm != step.comm:
                raise ScheduleError(
                    f"rank {rank}: one batch mixes communicators {op.comm} and {step.comm}"
                )
            if op.kind == "collective":
                issued = _Op(op, rank, batch, 0)
                batch.ops.append(issued)
                batch.left += 1
                self.by_key[rank][op.key] = issued
                continue
            pair = (op.comm, rank, op.peer) if op.kind == "send" else (op.comm, op.peer, rank)
            queue = (self.sends if op.kind == "send" else self.recvs).setdefault(pair, [])
            issued = _Op(op, rank, batch, len(queue))
            queue.append(issued)
            batch.ops.append(issued)
            batch.left += 1
            self.by_key[rank][op.key] = issued
            partner = self._partner(issued)
            if partner is not None:  # it may be waiting at the head of its stream
                self.touched.append(partner.batch.stream)
        stream = self.streams.setdefault(where, deque())
        stream.append(batch)
        if len(stream) == 1:
            self.touched.append(where)

    # -- streams ---------------------------------------------------------------------
    def _at_head(self, op: _Op) -> bool:
        stream = self.streams[op.batch.stream]
        return bool(stream) and stream[0] is op.batch

    def _partner(self, op: _Op) -> _Op | None:
        """The operation ``op`` matches (same place in its pair's order), if issued."""
        if op.partner is None:
            c, o = op.op.comm, op.op
            pair = (c, op.rank, o.peer) if o.kind == "send" else (c, o.peer, op.rank)
            others = (self.recvs if o.kind == "send" else self.sends).get(pair, [])
            if op.index < len(others):
                other = others[op.index]
                if other.op.key != o.key:
                    send, recv = (op, other) if o.kind == "send" else (other, op)
                    raise ScheduleError(
                        f"on communicator {c}, {recv.text()} would get the data of "
                        f"{send.text()}: NCCL matches the messages between two ranks in issue "
                        "order, so both must issue them in the same order"
                    )
                op.partner, other.partner = other, op
        return op.partner

    def _large(self, op: _Op) -> bool:
        """Whether ``op`` is a send that waits for its receive (rendezvous)."""
        size = op.op.nbytes
        return op.op.kind == "send" and (size is None or size > self.eager_limit)

    def _try(self, op: _Op) -> bool:
        """Complete ``op`` (at the head of its stream) if the rules allow; whether it did."""
        if op.op.kind == "collective":
            _complete(op)
            self.woken.append(op.rank)
            return True
        if op.op.kind == "send" and not self._large(op):
            _complete(op)
            self.woken.append(op.rank)
            partner = self._partner(op)
            if partner is not None:
                self.touched.append(partner.batch.stream)
            return True
        partner = self._partner(op)
        if partner is None:
            return False
        if op.op.kind == "recv" and not self._large(partner):
            if not partner.done and self._at_head(partner):
                _complete(partner)
            if partner.done:
                _complete(op)
        elif self._at_head(partner):
            _complete(op)
            _complete(partner)
        if op.done:
            self.touched.append(partner.batch.stream)
            self.woken.extend((op.rank, partner.rank))
        return op.done

    def progress(self, where: tuple[int, Hashable]) -> bool:
        """Complete what the head batches of stream ``where`` (a rank and its stream's
        label) can; whether any did."""
        stream = self.streams[where]
        moved = False
        while stream:
            head = stream[0]
            for op in head.ops:
                if not op.done:
                    moved = self._try(op) or moved
            if not head.done:
                break
            stream.popleft()
            self.woken.append(where[0])  # a Wait for the whole batch may return now
            moved = True
        return moved

    def run(self) -> None:
        """Advance hosts and streams until nothing can move (each is looked at again only
        when something it may wait for changed)."""
        while self.woken or self.touched:
            while self.woken:
                self.advance(self.woken.popleft())
            while self.touched:
                self.progress(self.touched.popleft())

    # -- what went wrong -------------------------------------------------------------
    def finished(self) -> bool:
        return all(
            pc == len(steps) for pc, steps in zip(self.pc, self.plan.ranks, strict=True)
        ) and not any(self.streams.values())

    def _blocked_on(self, node: tuple) -> tuple | None:
        """What a blocked host (``("host", rank)``) or operation (``("op", _Op)``) waits for
        (None: nothing, for a host whose step has ended)."""
        if node[0] == "host":
            rank = node[1]
            if self._ended(rank):
                return None
            step = self.plan.ranks[rank][self.pc[rank]]
            if isinstance(step, Wait):
                batches = [self.by_key[rank][k].batch for k in step.keys]
                op = next(o for b in batches for o in b.ops if not o.done)
                return ("op", op)
            comm = step.comm
            missing = sorted(set(comm.ranks) - self.arrived.get(comm, set()))
            return ("host", missing[0]) if missing else None
        op: _Op = node[1]
        stream = self.streams[op.batch.stream]
        if stream[0] is not op.batch:
            return ("op", next(o for o in stream[0].ops if not o.done))
        partner = self._partner(op)
        if partner is None:
            return ("host", op.op.peer)
        return ("op", partner)

    def _ended(self, rank: int) -> bool:
        return self.pc[rank] == len(self.plan.ranks[rank])

    def _text(self, node: tuple) -> str:
        if node[0] == "op":
            return f"{node[1].text()} on communicator {node[1].op.comm}"
        rank = node[1]
        if self._ended(rank):
            return f"rank {rank}, whose step has ended"
        step = self.plan.ranks[rank][self.pc[rank]]
        if isinstance(step, Wait):
            return f"rank {rank}'s host"
        return f"rank {rank}'s host in the set-up of communicator {step.comm}"

    @staticmethod
    def _link(a: tuple, b: tuple) -> str:
        if a[0] == "host":
            return " waits for "
        if b[0] == "host":
            return ", which waits for its match from "
        return ", queued behind " if b[1].rank == a[1].rank else ", which waits for "

    def cycle_error(self) -> CommDeadlockError:
        n = len(self.plan.ranks)
        start = next(r for r in range(n) if self.pc[r] < len(self.plan.ranks[r]))
        path: list[tuple] = []
        node: tuple | None = ("host", start)
        while node is not None and node not in path:
            path.append(node)
            node = self._blocked_on(node)
        closed = node is not None  # else a chain ending at a rank that has ended its step
        cycle = path[path.index(node) :] if closed else path
        hosts = [i for i, item in enumerate(cycle) if item[0] == "host"]
        if hosts and closed:
            cycle = cycle[hosts[0] :] + cycle[: hosts[0]]
        words = self._text(cycle[0])
        links = cycle[1:] + cycle[:1] if closed else cycle[1:]
        for a, b in zip(cycle, links, strict=False):
            words += self._link(a, b) + self._text(b) + (" again" if b is cycle[0] else "")
        ops = [item[1] for item in cycle if item[0] == "op"]
        ranks = sorted({item[1] if item[0] == "host" else item[1].rank for item in cycle})
        set_up = [
            self.plan.ranks[r][self.pc[r]]
            for kind, r in cycle
            if kind == "host" and not self._ended(r)
        ]
        comms = {o.op.comm for o in ops} | {s.comm for s in set_up if not isinstance(s, Wait)}
        comms = sorted(comms, key=Comm.setup_order)
        keys = sorted({o.op.key for o in ops}, key=key_text)
        names = ", ".join(dict.fromkeys(map(str, comms)))  # a group named once
        return CommDeadlockError(
            f"the plan deadlocks under NCCL's rules: {words} (ranks "
            f"{', '.join(map(str, ranks))}; communicators {names}"
            + (f"; messages {', '.join(map(key_text, keys))})" if keys else ")"),
            ranks,
            comms,
            keys,
        )


def check_nccl(
    plan: CommPlan,
    *,
    streams: Streams = "shared",
    collectives: Sequence[str] = COLLECTIVES,
    eager_limit: int = EAGER_LIMIT,
    bound: bool = True,
) -> NcclReport:
    """Run ``plan`` under NCCL's rules, with the step's ``collectives`` of other groups put
    in (:func:`~.step_collectives.with_collectives`), communicators on ``streams`` (by
    default all of a rank's on one: the worst case) and sends above ``eager_limit`` bytes
    rendezvous; return its report (without the in-flight bound unless ``bound``), or raise
    CommDeadlockError naming the cycle."""
    model = _Model(with_collectives(plan, collectives), eager_limit, streams)
    model.run()
    if not model.finished():
        raise model.cycle_error()
    comms = plan.comms
    per_rank = [sum(rank in c.ranks for c in comms) for rank in range(len(plan.ranks))]
    return NcclReport(comms, per_rank, inflight_bound(plan) if bound else [])


def inflight_bound(plan: CommPlan) -> list[int]:
    """Per rank, the most sends it can hold in flight at one of its Issue or Wait steps
    (after releasing those surely complete, counting those it issues there), whatever
    the timing: a send is surely complete once its own rank waited for its batch, or once
    its receiver's Wait for it is known, by vector clocks over the plan's messages, to
    have returned."""
    n = len(plan.ranks)
    clock = [[0] * n for _ in range(n)]  # clock[r][q]: steps of rank q known done at r
    at_send: dict[PlanKey, list[int]] = {}
    wait_index: dict[PlanKey, int] = {}  # the receiver's step whose return completes it
    for rank, steps in enumerate(plan.ranks):
        for i, step in enumerate(steps):
            if isinstance(step, Wait):
                for key in step.keys:
                    wait_index.setdefault(key, i) if _receives(plan, rank, key) else None
    pc = [0] * n
    pending: list[list[tuple[PlanKey, int]]] = [[] for _ in range(n)]  # (key, receiver)
    batch_of: list[dict[PlanKey, int]] = [{} for _ in range(n)]  # a key's Issue step
    bound = [0] * n
    moved = True
    while moved:
        moved = False
        for rank, steps in enumerate(plan.ranks):
            while pc[rank] < len(steps):
                step = steps[pc[rank]]
                if isinstance(step, Wait):
                    keys = [k for k in step.keys if _receives(plan, rank, k)]
                    if any(k not in at_send for k in keys):
                        break
                if isinstance(step, Issue | Wait):
                    known = clock[rank]
                    pending[rank] = [(k, q) for k, q in pending[rank] if known[q] <= wait_index[k]]
                if isinstance(step, Issue):
                    for op in step.ops:
                        batch_of[rank][op.key] = pc[rank]
                        if op.kind == "send":
                            at_send[op.key] = clock[rank][:]
                            pending[rank].append((op.key, op.peer))
                    bound[rank] = max(bound[rank], len(pending[rank]))
                elif isinstance(step, Wait):
                    bound[rank] = max(bound[rank], len(pending[rank]))
                    waited = {batch_of[rank][k] for k in step.keys}
                    pending[rank] = [
                        (k, q) for k, q in pending[rank] if batch_of[rank][k] not in waited
                    ]
                    for key in keys:
                        clock[rank] = [
                            max(a, b) for a, b in zip(clock[rank], at_send[key], strict=True)
                        ]
                pc[rank] += 1
                clock[rank][rank] = pc[rank]
                moved = True
    return bound


def _receives(plan: CommPlan, rank: int, key: PlanKey) -> bool:
    """Whether ``rank`` receives message ``key`` (else it sends it, or it is a collective)."""
    if key[0] == "collective":
        return False
    stage = key[1]
    placement = plan.schedule.placement
    return placement.rank_of(stage) == rank
