"""Discrete-event simulation of a lowered schedule under a cost model.

Each rank runs its actions in order. A compute action starts when the rank is free; a
receive completes when its message has arrived (send time plus one hop of latency); a
send takes no rank time. The same engine is the validator's dry run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from .cost import CostModel
from .ir import Action, Kind, Schedule, ScheduleError

__all__ = ["DeadlockError", "Message", "RankStats", "SimResult", "TimedAction", "simulate"]


class DeadlockError(ScheduleError):
    """The lowered schedule cannot complete: some ranks wait on messages never sent."""


class TimedAction(NamedTuple):
    """A compute action with its simulated (or measured) start and end."""

    action: Action
    start: float
    end: float


class Message(NamedTuple):
    """One point-to-point message: its receive key, ranks and times."""

    kind: Kind
    stage: int
    microbatch: int
    src: int
    dst: int
    sent: float
    arrived: float


@dataclass
class RankStats:
    """One rank's timeline and figures."""

    rank: int
    actions: list[TimedAction]
    busy: float
    peak_activations: int
    makespan: float = 0.0

    @property
    def idle(self) -> float:
        return self.makespan - self.busy

    @property
    def bubble_ratio(self) -> float:
        return self.idle / self.makespan if self.makespan else 0.0


@dataclass
class SimResult:
    """Figures of one simulated step. Activations count one stage's saved activations of
    one micro-batch as one unit, alive from its F until its W or BW."""

    schedule: Schedule
    cost: CostModel
    makespan: float
    ranks: list[RankStats]
    messages: list[Message] = field(default_factory=list)

    @property
    def bubble_ratio(self) -> float:
        """Idle time over all ranks' time."""
        total = self.makespan * len(self.ranks)
        return sum(r.idle for r in self.ranks) / total if total else 0.0

    @property
    def param_factor(self) -> float:
        return self.schedule.placement.param_factor

    def to_json(self) -> dict:
        """The stable ``simulate --json`` shape."""
        return {
            "schedule": self.schedule.name,
            "pp": self.schedule.num_ranks,
            "microbatches": self.schedule.num_microbatches,
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "param_factor": self.param_factor,
            "ranks": [
                {
                    "rank": r.rank,
                    "bubble_ratio": r.bubble_ratio,
                    "busy": r.busy,
                    "peak_activations": r.peak_activations,
                    "actions": [
                        {**t.action.to_json(), "start": t.start, "end": t.end} for t in r.actions
                    ],
                }
                for r in self.ranks
            ],
        }


_ALLOC = {Kind.F: 1, Kind.B: 0, Kind.W: 0, Kind.BW: 0}
_FREE = {Kind.F: 0, Kind.B: 0, Kind.W: 1, Kind.BW: 1}


def _activation_delta(action: Action) -> tuple[int, int]:
    """Units allocated at the start and freed at the end of a compute action."""
    if action.kind is Kind.FB:
        return sum(_ALLOC[h.kind] for h in action.sub), sum(_FREE[h.kind] for h in action.sub)
    return _ALLOC[action.kind], _FREE[action.kind]


# Named tuples built without their Python-level __new__: the engine makes ~10^5 of each.
_new_timed = partial(tuple.__new__, TimedAction)
_new_message = partial(tuple.__new__, Message)


def simulate(schedule: Schedule, cost: CostModel | None = None) -> SimResult:
    """Simulate ``schedule``. A compute-only schedule is run as if lowered (each receive
    right before its consumer, each send right after its producer) without building the
    communication actions; a lowered schedule runs its own sends and receives."""
    cost = cost or CostModel()
    placement = schedule.placement
    cost.check_fits(placement.num_model_stages, placement.num_ranks)
    engine = _Engine(schedule, cost)
    engine.run()
    return engine.result()


class _Engine:
    """The event loop: ranks run until they block on a message; a send wakes its receiver."""

    def __init__(self, schedule: Schedule, cost: CostModel):
        self.schedule, self.cost = schedule, cost
        p = schedule.placement
        self.implicit = not schedule.is_lowered
        n = p.num_ranks
        self.pc, self.clock, self.busy = [0] * n, [0.0] * n, [0.0] * n
        self.live, self.peak = [0] * n, [0] * n
        self.timelines: list[list[TimedAction]] = [[] for _ in range(n)]
        self.arrived: dict[tuple, tuple[float, int]] = {}
        self.waiting: dict[tuple, int] = {}
        self.blocked_on: dict[int, tuple] = {}
        self.messages: list[Message] = []
        self.ready = deque(range(n))
        self.next_stage = [p.next_stage(s) for s in range(p.num_stages)]
        self.prev_stage = [p.prev_stage(s) for s in range(p.num_stages)]
        self.prev_remote = [
            q is not None and p.rank_of(q) != p.rank_of(s) for s, q in enumerate(self.prev_stage)
        ]
        self.next_remote = [
            q is not None and p.rank_of(q) != p.rank_of(s) for s, q in enumerate(self.next_stage)
        ]
        self.facts: dict[tuple, tuple[float, int, int]] = {}

    def _routes(self) -> tuple[dict, dict]:
        """Per (kind, stage): the receive kind a compute half waits for, and the (receive
        kind, stage) of the message it sends; None where the neighbour is local or absent."""
        inputs: dict[tuple[Kind, int], Kind | None] = {}
        outputs: dict[tuple[Kind, int], tuple[Kind, int] | None] = {}
        for s in range(len(self.next_stage)):
            forward_out = (Kind.RECV_F, self.next_stage[s]) if self.next_remote[s] else None
            backward_out = (Kind.RECV_B, self.prev_stage[s]) if self.prev_remote[s] else None
            inputs[(Kind.F, s)] = Kind.RECV_F if self.prev_remote[s] else None
            outputs[(Kind.F, s)] = forward_out
            for kind in (Kind.B, Kind.BW):
                inputs[(kind, s)] = Kind.RECV_B if self.next_remote[s] else None
                outputs[(kind, s)] = backward_out
            inputs[(Kind.W, s)] = outputs[(Kind.W, s)] = None
        return inputs, outputs

    def _send(self, key: tuple, now: float, rank: int) -> None:
        self.arrived[key] = (now, rank)
        waiter = self.waiting.pop(key, None)
        if waiter is not None:
            self.ready.append(waiter)

    def _receive(self, key: tuple, now: float, rank: int) -> float | None:
        """The time the message is in hand, or None (and the rank waits) if not yet sent."""
        got = self.arrived.pop(key, None)
        if got is None:
            self.waiting[key] = rank
            self.blocked_on[rank] = key
            return None
        sent, src = got
        arrival = sent + self.cost.latency
        self.messages.append(_new_message((*key, src, rank, sent, arrival)))
        return max(now, arrival)

    def _compute_facts(self, action: Action, rank: int) -> tuple[float, int, int]:
        sub = action.sub
        memo = (rank, action.kind, action.stage) + ((sub[1].kind, sub[1].stage) if sub else ())
        facts = self.facts.get(memo)
        if facts is None:
            alloc, free = _activation_delta(action)
            duration = self.cost.duration(action, rank, self.schedule.placement.model_stage)
            facts = self.facts[memo] = (duration, alloc, free)
        return facts

    def run(self) -> None:
        """Advance ranks until every one has finished or waits for a message never sent."""
        programs, implicit = self.schedule.ranks, self.implicit
        route_in, route_out = self._routes()
        arrived, receive, send = self.arrived, self._receive, self._send
        recv_f, recv_b, send_f, send_b = Kind.RECV_F, Kind.RECV_B, Kind.SEND_F, Kind.SEND_B
        next_stage, prev_stage = self.next_stage, self.prev_stage
        while self.ready:
            rank = self.ready.popleft()
            actions, timeline = programs[rank], self.timelines[rank]
            i, now, busy = self.pc[rank], self.clock[rank], self.busy[rank]
            live, peak = self.live[rank], self.peak[rank]
            while i < len(actions):
                action = actions[i]
                kind = action.kind
                if kind is recv_f or kind is recv_b:
                    got = receive((kind, action.stage, action.microbatch), now, rank)
                    if got is None:
                        break
                    now = got
                elif kind is send_f:
                    send((recv_f, next_stage[action.stage], action.microbatch), now, rank)
                elif kind is send_b:
                    send((recv_b, prev_stage[action.stage], action.microbatch), now, rank)
                else:
                    halves = action.sub or (action,)
                    if implicit:
                        keys = [
                            (r, h.stage, h.microbatch)
                            for h in halves
                            if (r := route_in[(h.kind, h.stage)]) is not None
                        ]
                        if any(k not in arrived for k in keys):
                            # Wait for all inputs before consuming any.
                            receive(next(k for k in keys if k not in arrived), now, rank)
                            break
                        for key in keys:
                            now = receive(key, now, rank)
                    duration, alloc, free = self._compute_facts(action, rank)
                    live += alloc
                    if live > peak:
                        peak = live
                    live -= free
                    timeline.append(_new_timed((action, now, now + duration)))
                    busy += duration
                    now += duration
                    if implicit:
                        for h in halves:
                            out = route_out[(h.kind, h.stage)]
                            if out is not None:
                                send((out[0], out[1], h.microbatch), now, rank)
                i += 1
            self.pc[rank], self.clock[rank], self.busy[rank] = i, now, busy
            self.live[rank], self.peak[rank] = live, peak

    def result(self) -> SimResult:
        p, programs = self.schedule.placement, self.schedule.ranks
        stuck = [r for r in range(p.num_ranks) if self.pc[r] < len(programs[r])]
        if stuck:
            details = "; ".join(
                f"rank {r} waits at {programs[r][self.pc[r]]} for "
                f"{_key_text(self.blocked_on[r])} from rank {self._sender(self.blocked_on[r])}"
                for r in stuck
            )
            raise DeadlockError(f"the schedule deadlocks: {details}")
        if self.arrived:
            key, (_, src) = next(iter(self.arrived.items()))
            raise ScheduleError(
                f"rank {src} sends {_key_text(key)} to rank {p.rank_of(key[1])}, which never "
                "receives it"
            )
        makespan = max(self.clock, default=0.0)
        ranks = [
            RankStats(r, self.timelines[r], self.busy[r], self.peak[r], makespan)
            for r in range(p.num_ranks)
        ]
        return SimResult(self.schedule, self.cost, makespan, ranks, self.messages)

    def _sender(self, key: tuple) -> int:
        kind, stage, _ = key
        source = self.prev_stage[stage] if kind is Kind.RECV_F else self.next_stage[stage]
        return self.schedule.placement.rank_of(source)


def _key_text(key: tuple) -> str:
    kind, stage, mb = key
    return f"{stage}{kind.value}{mb}"
