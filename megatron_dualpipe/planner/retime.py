"""The simulator's timing of one schedule, again and again under different per-stage costs.

:func:`.simulate.simulate` runs a schedule's event loop once. A search that keeps the
schedule and changes only the stages' F, B and W (the balance advisor) would pay that loop
for every candidate; :class:`Retimer` pays it once: it records each compute action's
inputs (the action on the same rank before it, and the actions on other ranks whose
messages it waits for) in an order that respects them, and then times the schedule in
one pass per cost. Same semantics as the simulator with no latency: an action starts when
its rank is free and its inputs have been sent, and an FB pair lasts the sum of its
halves, or, given each stage's all-to-all, as long as the busier of its halves' compute
and their all-to-all (a lone pass: the two one after the other).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ..schedules.ir import Action, Kind, Schedule, ScheduleError

__all__ = ["Retimer"]

_PARTS = {Kind.F: (0,), Kind.B: (1,), Kind.W: (2,), Kind.BW: (1, 2)}


class Retimer:
    """Times a compute-only ``schedule`` for per-model-stage costs ``(f, b, w)``."""

    def __init__(self, schedule: Schedule):
        if schedule.is_lowered:
            schedule = schedule.compute_only()
        p = schedule.placement
        self.num_ranks = p.num_ranks
        where: dict[tuple[str, int, int], int] = {}  # (F or B, stage, micro-batch) -> node
        nodes: list[tuple[int, Action]] = []
        for rank, actions in enumerate(schedule.ranks):
            for action in actions:
                for half in action.sub or (action,):
                    if half.kind in (Kind.F, Kind.B, Kind.BW):
                        side = "F" if half.kind is Kind.F else "B"
                        where[(side, half.stage, half.microbatch)] = len(nodes)
                nodes.append((rank, action))
        preds: list[list[int]] = [[] for _ in nodes]
        previous: dict[int, int] = {}
        for i, (rank, action) in enumerate(nodes):
            if rank in previous:
                preds[i].append(previous[rank])
            previous[rank] = i
            for half in action.sub or (action,):
                if half.kind is Kind.F:
                    source = p.prev_stage(half.stage)
                    key = ("F", source, half.microbatch)
                elif half.kind in (Kind.B, Kind.BW):
                    source = p.next_stage(half.stage)
                    key = ("B", source, half.microbatch)
                else:
                    continue
                if source is not None and p.rank_of(source) != rank:
                    if key not in where:
                        raise ScheduleError(f"{half} waits for an action the schedule lacks")
                    preds[i].append(where[key])
        self.order = _topological(preds)
        # Each action's duration is a sum of (model stage, F/B/W) terms; actions with the
        # same terms share one entry of a per-cost table.
        kinds: dict[tuple[int, ...], int] = {}
        self.kind = []
        for _, action in nodes:
            terms = tuple(
                3 * p.model_stage(h.stage) + part
                for h in action.sub or (action,)
                for part in _PARTS.get(h.kind, ())
            )
            self.kind.append(kinds.setdefault((bool(action.sub), *terms), len(kinds)))
        self.kinds = list(kinds)
        self.steps = [(i, tuple(preds[i]), self.kind[i]) for i in self.order]
        self.rank = [rank for rank, _ in nodes]

    def timed(
        self,
        costs: Sequence[tuple[float, float, float]],
        a2a: Sequence[tuple[float, float]] | None = None,
    ) -> tuple[float, list[float]]:
        """The simulated step under ``costs`` (one ``(f, b, w)`` per model stage; with
        ``a2a``, each stage's F and B all-to-all, as :class:`~..schedules.cost.CostModel`'s
        ``stage_a2a``: ``costs`` are then compute only), and each rank's busy time (the sum
        of its actions' times, as :class:`~..schedules.simulate.SimResult`'s ranks have
        it)."""
        flat = [x for triple in costs for x in triple]
        if a2a is None:
            table = [sum(flat[t] for t in terms) for _, *terms in self.kinds]
        else:
            exchanged = [x for pair in a2a for x in pair]
            table = []
            for paired, *terms in self.kinds:  # a term t is part t % 3 (F, B, W) of t // 3
                compute = sum(flat[t] for t in terms)
                comm = sum(exchanged[2 * (t // 3) + t % 3] for t in terms if t % 3 < 2)
                table.append(max(compute, comm) if paired else compute + comm)
        end = [0.0] * len(self.kind)
        busy = [0.0] * self.num_ranks
        for i, preds, kind in self.steps:
            start = 0.0
            for j in preds:
                if end[j] > start:
                    start = end[j]
            end[i] = start + table[kind]
            busy[self.rank[i]] += table[kind]
        return max(end, default=0.0), busy


def _topological(preds: list[list[int]]) -> list[int]:
    """An order of the nodes with every node after its predecessors (Kahn)."""
    waiting = [len(p) for p in preds]
    users: list[list[int]] = [[] for _ in preds]
    for i, p in enumerate(preds):
        for j in p:
            users[j].append(i)
    ready = deque(i for i, n in enumerate(waiting) if n == 0)
    order: list[int] = []
    while ready:
        i = ready.popleft()
        order.append(i)
        for k in users[i]:
            waiting[k] -= 1
            if waiting[k] == 0:
                ready.append(k)
    if len(order) != len(preds):
        raise ScheduleError("the schedule's actions wait on each other in a cycle (deadlock)")
    return order
