"""A simulated step against its compute bound, and where each rank's rest of the step goes.

:func:`step_bound` sets a step against its compute bound (every F, B and W of every stage
and micro-batch without its all-to-all, shared evenly over the ranks) and splits each
rank's step into its compute, the all-to-all it waits for (``exposed``), ``idle``,
``imbalance`` (its compute beyond the bound) and ``hidden``, so that on every rank the step
beyond the bound is ``exposed + idle + imbalance - hidden``; the split's bound is the
busiest rank's compute. Pure Python. What each term means, and why: docs/schedules.md,
"The simulator" (the compute bound).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..schedules.ir import COMPUTE_KINDS, Action
from ..schedules.simulate import SimResult

__all__ = ["RankShare", "StepBound", "step_bound"]


@dataclass(frozen=True)
class RankShare:
    """One rank's step, split: ``compute``, ``exposed`` all-to-all, ``idle``,
    ``imbalance`` (its compute minus the bound) and ``hidden`` (docs/schedules.md)."""

    rank: int
    compute: float
    exposed: float
    idle: float
    imbalance: float
    hidden: float

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "compute": self.compute,
            "exposed_a2a": self.exposed,
            "idle": self.idle,
            "imbalance": self.imbalance,
            "hidden": self.hidden,
        }


@dataclass(frozen=True)
class StepBound:
    """A step, its compute bound and each rank's :class:`RankShare`."""

    step: float
    bound: float
    ranks: tuple[RankShare, ...]

    @property
    def ratio(self) -> float:
        """The step over the bound (1.0: as fast as the hardware allows)."""
        return self.step / self.bound if self.bound else float("inf")

    @property
    def efficiency(self) -> float:
        """The bound over the step: the share of the bound reached."""
        return self.bound / self.step if self.step else 0.0

    @property
    def split_bound(self) -> float:
        """The busiest rank's compute: the split's bound (docs/schedules.md)."""
        return max((r.compute for r in self.ranks), default=0.0)

    @property
    def split_ratio(self) -> float:
        """The step over the split's bound (1.0: the schedule costs nothing on this split)."""
        return self.step / self.split_bound if self.split_bound else float("inf")

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "compute_bound": self.bound,
            "step_over_bound": self.ratio,
            "split_bound": self.split_bound,
            "step_over_split_bound": self.split_ratio,
            "ranks": [r.to_json() for r in self.ranks],
        }


def _kind_key(action: Action) -> tuple:
    """What an action's time and compute depend on besides its rank."""
    if action.sub:
        return (action.kind, *((h.kind, h.stage) for h in action.sub))
    return (action.kind, action.stage)


def step_bound(result: SimResult) -> StepBound:
    """``result``'s step against its compute bound, each rank's share split."""
    schedule, cost = result.schedule, result.cost
    model_stage = schedule.placement.model_stage
    figures = []
    for stats, actions in zip(result.ranks, schedule.ranks, strict=True):
        counted: Counter[tuple] = Counter()
        first: dict[tuple, Action] = {}
        for a in actions:
            if a.kind in COMPUTE_KINDS:
                key = _kind_key(a)
                counted[key] += 1
                first.setdefault(key, a)
        compute = exposed = hidden = 0.0
        for key, n in counted.items():
            action = first[key]
            c = cost.compute(action, stats.rank, model_stage)
            d = cost.duration(action, stats.rank, model_stage)
            compute += n * c
            exposed += n * max(0.0, d - c)
            hidden += n * max(0.0, c - d)
        figures.append((stats.rank, compute, exposed, stats.idle, hidden))
    bound = sum(f[1] for f in figures) / len(figures) if figures else 0.0
    ranks = tuple(RankShare(r, c, e, i, c - bound, h) for r, c, e, i, h in figures)
    return StepBound(result.makespan, bound, ranks)
