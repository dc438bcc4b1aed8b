"""One optimisation instance: a placement, per-stage costs and per-rank memory caps, with
the tables the list scheduler, the bound and the MILP read (durations, neighbours, which
micro-batches pass each stage, which channel each message takes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...schedules.cost import CostModel
from ...schedules.ir import Action, Kind, Placement, ScheduleError

__all__ = ["Instance"]


@dataclass
class Instance:
    """``cost`` is per stage (as :func:`~megatron_dualpipe.schedules.simulate` takes it);
    ``caps[r]`` is rank r's limit on live activations, in units of one stage's activations
    of one micro-batch (the simulator's unit)."""

    placement: Placement
    cost: CostModel
    caps: tuple[int, ...]
    # Derived tables, per stage s unless said otherwise.
    rank: list[int] = field(init=False)
    chunk: list[int] = field(init=False)
    prev: list[int | None] = field(init=False)
    next: list[int | None] = field(init=False)
    prev_remote: list[bool] = field(init=False)
    next_remote: list[bool] = field(init=False)
    #: Micro-batches passing the stage, in the order every stage of a path runs them.
    mbs: list[list[int]] = field(init=False)
    #: Whether a micro-batch forwarded here later needs another stage of the same rank.
    revisits: list[bool] = field(init=False)
    f: list[float] = field(init=False)
    b: list[float] = field(init=False)
    w: list[float] = field(init=False)
    #: Per rank: its stages, in chunk order.
    stages_of: list[list[int]] = field(init=False)
    #: (forward stage, backward stage, backward is BW) -> duration of that FB pair.
    pair: dict[tuple[int, int, bool], float] = field(init=False)
    #: Forward and backward channel of each stage's incoming message (None where local).
    f_channel: list[tuple[int, int] | None] = field(init=False)
    b_channel: list[tuple[int, int] | None] = field(init=False)
    #: Whether any channel carries messages of more than one stage (then order matters).
    shared_channels: bool = field(init=False)

    def __post_init__(self) -> None:
        p, cost = self.placement, self.cost
        cost.check_fits(p.num_model_stages, p.num_ranks)
        if len(self.caps) != p.num_ranks:
            raise ScheduleError(
                f"memory caps name {len(self.caps)} ranks, the schedule has {p.num_ranks}"
            )
        stages = range(p.num_stages)
        self.rank = [p.rank_of(s) for s in stages]
        self.chunk = [p.chunk_of(s) for s in stages]
        self.prev = [p.prev_stage(s) for s in stages]
        self.next = [p.next_stage(s) for s in stages]
        self.prev_remote = [
            q is not None and self.rank[q] != self.rank[s] for s, q in enumerate(self.prev)
        ]
        self.next_remote = [
            q is not None and self.rank[q] != self.rank[s] for s, q in enumerate(self.next)
        ]
        self.mbs = [[m for m in range(p.num_microbatches) if s in p.path(m)] for s in stages]
        self.revisits = [self._revisits(s) for s in stages]
        self.stages_of = [
            [p.stage_of(r, c) for c in range(p.num_chunks)] for r in range(p.num_ranks)
        ]

        def duration(kind: Kind, s: int) -> float:
            return cost.duration(Action(kind, s, 0, self.chunk[s]), self.rank[s], p.model_stage)

        self.f = [duration(Kind.F, s) for s in stages]
        self.b = [duration(Kind.B, s) for s in stages]
        self.w = [duration(Kind.W, s) for s in stages]
        self.pair = {}
        for r, own in enumerate(self.stages_of):
            for sf in own:
                forward = Action(Kind.F, sf, 0, self.chunk[sf])
                for sb in own:
                    for bw in (False, True):
                        backward = Action(Kind.BW if bw else Kind.B, sb, 1, self.chunk[sb])
                        pair = Action.overlapped(forward, backward)
                        self.pair[(sf, sb, bw)] = cost.duration(pair, r, p.model_stage)
        self.f_channel = [
            (self.rank[q], self.rank[s]) if self.prev_remote[s] else None
            for s, q in enumerate(self.prev)
        ]
        self.b_channel = [
            (self.rank[q], self.rank[s]) if self.next_remote[s] else None
            for s, q in enumerate(self.next)
        ]
        seen_f = [c for c in self.f_channel if c is not None]
        seen_b = [c for c in self.b_channel if c is not None]
        self.shared_channels = len(set(seen_f)) < len(seen_f) or len(set(seen_b)) < len(seen_b)

    def _revisits(self, stage: int) -> bool:
        here, s = self.rank[stage], self.next[stage]
        while s is not None:
            if self.rank[s] == here:
                return True
            s = self.next[s]
        return False

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    def pair_pays(self, sf: int, sb: int, bw: bool) -> bool:
        """Whether issuing F(sf) with the backward of sb together is shorter than apart."""
        alone = self.f[sf] + self.b[sb] + (self.w[sb] if bw else 0.0)
        return self.pair[(sf, sb, bw)] < alone - 1e-12

    def any_pair_pays(self, rank: int) -> bool:
        own = self.stages_of[rank]
        return any(self.pair_pays(a, b, bw) for a in own for b in own for bw in (False, True))

    def work(self, rank: int) -> float:
        """Rank ``rank``'s compute with nothing paired."""
        return sum(
            len(self.mbs[s]) * (self.f[s] + self.b[s] + self.w[s]) for s in self.stages_of[rank]
        )
