"""Discrete-event simulation of a lowered schedule under a cost model.

Each rank runs its actions in order. A compute action starts when the rank is free; a
receive completes when its message has arrived (send time plus one hop of latency); a
send takes no rank time. The same engine is the validator's dry run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from .cost import CostModel
from .ir import Action, Kind, Schedule, ScheduleError, action_text

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


def simulate(
    schedule: Schedule,
    cost: CostModel | None = None,
    *,
    timeline: bool = True,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Simulate ``schedule``. A compute-only schedule is run as if lowered (each receive
    right before its consumer, each send right after its producer) without building the
    communication actions; a lowered schedule runs its own sends and receives.

    ``timeline=False`` keeps only the figures (busy time, peaks, makespan): the result's
    ``ranks[r].actions`` and ``messages`` stay empty, and memory does not grow with the
    schedule. ``progress`` is called now and then with the number of actions run so far.
    Time and memory are linear in the number of actions."""
    cost = cost or CostModel()
    placement = schedule.placement
    cost.check_fits(placement.num_model_stages, placement.num_ranks)
    engine = _Engine(schedule, cost, timeline, progress)
    engine.run()
    return engine.result()


#: How many actions run between two calls of a progress callback.
_PROGRESS_EVERY = 50_000


class _Engine:
    """The event loop: ranks run until they block on a message; a send wakes its receiver.

    A message is an int: ``s * M + m`` is the forward input of stage s for micro-batch m,
    ``(S + s) * M + m`` the gradient of stage s's output (S stages, M micro-batches).
    ``arrived`` maps a message sent and not yet received to its send time. The inner loop
    tells kinds apart by identity and looks facts up by stage: it hashes no enum."""

    def __init__(
        self,
        schedule: Schedule,
        cost: CostModel,
        timeline: bool,
        progress: Callable[[int], None] | None,
    ):
        self.schedule, self.cost = schedule, cost
        self.timeline, self.progress = timeline, progress
        p = schedule.placement
        self.implicit = not schedule.is_lowered
        n, self.S, self.M = p.num_ranks, p.num_stages, p.num_microbatches
        self.pc, self.clock, self.busy = [0] * n, [0.0] * n, [0.0] * n
        self.live, self.peak = [0] * n, [0] * n
        self.timelines: list[list[TimedAction]] = [[] for _ in range(n)]
        self.arrived: dict[int, float] = {}
        self.waiting: dict[int, int] = {}
        self.blocked_on: dict[int, int] = {}
        self.messages: list[Message] = []
        self.ready = deque(range(n))
        self.next_stage = [p.next_stage(s) for s in range(self.S)]
        self.prev_stage = [p.prev_stage(s) for s in range(self.S)]
        self.rank_of = [p.rank_of(s) for s in range(self.S)]
        self.plain = {kind: self._plain_facts(kind) for kind in (Kind.F, Kind.B, Kind.W, Kind.BW)}
        self.pairs: dict[int, tuple[float, int, int, int, int, int, int]] = {}

    def _bases(self, kind: Kind, s: int) -> tuple[int, int]:
        """The bases (add the micro-batch) of the message a compute half of ``kind`` on
        stage ``s`` waits for and of the one it sends; -1 where that neighbour is on the
        same rank, absent, or the schedule is lowered (it sends and receives itself)."""
        if not self.implicit or kind is Kind.W:
            return -1, -1
        S, M = self.S, self.M
        prev, nxt = self.prev_stage[s], self.next_stage[s]
        prev_remote, next_remote = self.schedule.placement.remote_neighbours(s)
        if kind is Kind.F:
            return (s * M if prev_remote else -1), (nxt * M if next_remote else -1)
        return ((S + s) * M if next_remote else -1), ((S + prev) * M if prev_remote else -1)

    def _plain_facts(self, kind: Kind) -> list[tuple[float, int, int, int, int]]:
        """Per stage, what the engine needs of a ``kind`` action there, bar its
        micro-batch: (duration, activations allocated at the start, freed at the end, the
        bases of the message it waits for and of the one it sends)."""
        p = self.schedule.placement
        facts = []
        for s in range(self.S):
            action = Action(kind, s, 0, p.chunk_of(s))
            duration = self.cost.duration(action, self.rank_of[s], p.model_stage)
            facts.append((duration, *_activation_delta(action), *self._bases(kind, s)))
        return facts

    def _pair_facts(self, code: int, action: Action) -> tuple[float, int, int, int, int, int, int]:
        """The same for an FB action, memoised under ``code`` (its halves' stages and
        backward kind), with the bases of its backward half appended."""
        forward, backward = action.sub
        p = self.schedule.placement
        duration = self.cost.duration(action, self.rank_of[action.stage], p.model_stage)
        facts = (
            duration,
            *_activation_delta(action),
            *self._bases(forward.kind, forward.stage),
            *self._bases(backward.kind, backward.stage),
        )
        self.pairs[code] = facts
        return facts

    def _comm_ids(self) -> dict[tuple[Kind, int], int]:
        """Per (communication kind, stage) of a lowered schedule: its message's base."""
        S, M = self.S, self.M
        ids: dict[tuple[Kind, int], int] = {}
        for s in range(S):
            ids[(Kind.RECV_F, s)] = s * M
            ids[(Kind.RECV_B, s)] = (S + s) * M
            if self.next_stage[s] is not None:
                ids[(Kind.SEND_F, s)] = self.next_stage[s] * M
            if self.prev_stage[s] is not None:
                ids[(Kind.SEND_B, s)] = (S + self.prev_stage[s]) * M
        return ids

    def _record(self, key: int, sent: float, dst: int) -> None:
        kind, stage, mb = self._decode(key)
        arrival = sent + self.cost.latency
        self.messages.append(_new_message((kind, stage, mb, self._sender(key), dst, sent, arrival)))

    def run(self) -> None:
        """Advance ranks until every one has finished or waits for a message never sent."""
        programs, keep = self.schedule.ranks, self.timeline
        comm = {} if self.implicit else self._comm_ids()
        arrived, waiting, ready = self.arrived, self.waiting, self.ready
        blocked_on, record = self.blocked_on, self._record
        latency, two_s = self.cost.latency, 2 * self.S
        F, B, W, BW, FB = Kind.F, Kind.B, Kind.W, Kind.BW, Kind.FB
        f_facts, b_facts, w_facts, bw_facts = (self.plain[k] for k in (F, B, W, BW))
        pairs, pair_facts = self.pairs, self._pair_facts
        send_f, send_b = Kind.SEND_F, Kind.SEND_B
        done = reported = 0
        while ready:
            rank = ready.popleft()
            actions, timeline = programs[rank], self.timelines[rank]
            first = i = self.pc[rank]
            now, busy = self.clock[rank], self.busy[rank]
            live, peak = self.live[rank], self.peak[rank]
            end = len(actions)
            while i < end:
                action = actions[i]
                kind, mb = action[0], action[2]
                if kind is F or kind is B or kind is W or kind is BW:
                    if kind is F:
                        duration, alloc, free, wait, send = f_facts[action[1]]
                    elif kind is B:
                        duration, alloc, free, wait, send = b_facts[action[1]]
                    elif kind is W:
                        duration, alloc, free, wait, send = w_facts[action[1]]
                    else:
                        duration, alloc, free, wait, send = bw_facts[action[1]]
                    if wait >= 0:
                        key = wait + mb
                        sent = arrived.pop(key, None)
                        if sent is None:
                            waiting[key] = rank
                            blocked_on[rank] = key
                            break
                        if keep:
                            record(key, sent, rank)
                        if sent + latency > now:
                            now = sent + latency
                    live += alloc
                    if live > peak:
                        peak = live
                    live -= free
                    if keep:
                        timeline.append(_new_timed((action, now, now + duration)))
                    busy += duration
                    now += duration
                    if send >= 0:
                        key = send + mb
                        arrived[key] = now
                        waiter = waiting.pop(key, None)
                        if waiter is not None:
                            ready.append(waiter)
                elif kind is FB:
                    backward = action[4][1]
                    mb2 = backward[2]
                    code = (action[1] * two_s + backward[1]) * 2 + (backward[0] is BW)
                    facts = pairs.get(code) or pair_facts(code, action)
                    duration, alloc, free, wait, send, wait2, send2 = facts
                    key = wait + mb if wait >= 0 else -1
                    key2 = wait2 + mb2 if wait2 >= 0 else -1
                    if key >= 0 and key not in arrived:  # wait for both inputs, then take
                        waiting[key] = rank
                        blocked_on[rank] = key
                        break
                    if key2 >= 0 and key2 not in arrived:
                        waiting[key2] = rank
                        blocked_on[rank] = key2
                        break
                    for k in (key, key2):
                        if k >= 0:
                            sent = arrived.pop(k)
                            if keep:
                                record(k, sent, rank)
                            if sent + latency > now:
                                now = sent + latency
                    live += alloc
                    if live > peak:
                        peak = live
                    live -= free
                    if keep:
                        timeline.append(_new_timed((action, now, now + duration)))
                    busy += duration
                    now += duration
                    for k in (send + mb if send >= 0 else -1, send2 + mb2 if send2 >= 0 else -1):
                        if k >= 0:
                            arrived[k] = now
                            waiter = waiting.pop(k, None)
                            if waiter is not None:
                                ready.append(waiter)
                else:  # a send or receive of a lowered schedule
                    key = comm[(kind, action[1])] + mb
                    if kind is send_f or kind is send_b:
                        arrived[key] = now
                        waiter = waiting.pop(key, None)
                        if waiter is not None:
                            ready.append(waiter)
                    else:
                        sent = arrived.pop(key, None)
                        if sent is None:
                            waiting[key] = rank
                            blocked_on[rank] = key
                            break
                        if keep:
                            record(key, sent, rank)
                        if sent + latency > now:
                            now = sent + latency
                i += 1
            self.pc[rank], self.clock[rank], self.busy[rank] = i, now, busy
            self.live[rank], self.peak[rank] = live, peak
            done += i - first
            if self.progress is not None and done - reported >= _PROGRESS_EVERY:
                self.progress(done)
                reported = done

    def result(self) -> SimResult:
        p, programs = self.schedule.placement, self.schedule.ranks
        stuck = [r for r in range(p.num_ranks) if self.pc[r] < len(programs[r])]
        if stuck:
            details = "; ".join(
                f"rank {r} waits at {programs[r][self.pc[r]]} for "
                f"{action_text(*self._decode(self.blocked_on[r]))} from rank "
                f"{self._sender(self.blocked_on[r])}"
                for r in stuck
            )
            raise DeadlockError(f"the schedule deadlocks: {details}")
        if self.arrived:
            key = next(iter(self.arrived))
            _, stage, _ = decoded = self._decode(key)
            raise ScheduleError(
                f"rank {self._sender(key)} sends {action_text(*decoded)} to rank "
                f"{p.rank_of(stage)}, which never receives it"
            )
        makespan = max(self.clock, default=0.0)
        ranks = [
            RankStats(r, self.timelines[r], self.busy[r], self.peak[r], makespan)
            for r in range(p.num_ranks)
        ]
        return SimResult(self.schedule, self.cost, makespan, ranks, self.messages)

    def _decode(self, key: int) -> tuple[Kind, int, int]:
        """A message's receive key: (RECV_F or RECV_B, receiving stage, micro-batch)."""
        stage, mb = divmod(key, self.M)
        if stage < self.S:
            return Kind.RECV_F, stage, mb
        return Kind.RECV_B, stage - self.S, mb

    def _sender(self, key: int) -> int:
        kind, stage, _ = self._decode(key)
        source = self.prev_stage[stage] if kind is Kind.RECV_F else self.next_stage[stage]
        return self.rank_of[source]
