"""The cost model: how long each action takes in the simulator."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from .ir import Action, Kind, ScheduleError

__all__ = ["CostModel"]

#: Which of (F, B, W) each compute kind performs.
_PARTS = {Kind.F: (0,), Kind.B: (1,), Kind.W: (2,), Kind.BW: (1, 2)}
#: The largest time or factor a cost model takes (the advisor's are FLOP counts, 1e15 and
#: more): a cost times a scale, summed over millions of actions, stays far from overflow.
MAX_COST = 1e100


def _in_range(value: float) -> bool:
    return math.isfinite(value) and 0 <= value <= MAX_COST


def _malformed(entries: tuple[tuple[float, ...], ...], size: int) -> bool:
    """Whether an entry of ``entries`` is not ``size`` numbers in range."""
    return any(len(entry) != size or not all(map(_in_range, entry)) for entry in entries)


@dataclass(frozen=True)
class CostModel:
    """Durations in arbitrary time units.

    ``f``, ``b`` and ``w`` are one stage's forward, input-gradient (dX) and weight-gradient
    (dW) times; a full backward (BW) takes ``b + w``. An FB pair takes ``fb`` when given,
    else ``overlap`` times the sum of its halves (1.0: no overlap benefit). ``latency`` is
    the time one message takes over one hop. ``stage_scale`` (per model stage) and
    ``rank_scale`` (per rank) multiply compute times, for uneven stages or slow ranks.
    ``stage_costs`` gives each model stage its own ``(f, b, w)`` instead (stages whose
    parts differ, such as one holding the output layer and the loss); an FB pair then
    takes ``overlap`` times the sum of its halves.

    ``a2a_f`` and ``a2a_b`` are the shares of F's and of B's time that are all-to-all (a
    lone pass waits for it; an FB pair may hide it): the rest, and all of W, is compute,
    what the compute bound counts (:mod:`megatron_dualpipe.planner.bound`). 0 (the
    default): all compute.

    ``stage_a2a`` gives each model stage its own all-to-all times instead, ``(F's, B's)``
    beside ``stage_costs``, which then hold compute only (a profile laid over a model's
    split: only its MoE layers exchange tokens). A lone pass takes its compute and its
    all-to-all one after the other; an FB pair runs its halves' compute on the compute
    streams and their all-to-all on the communication stream, and lasts as long as the
    busier of the two (DeepSeek's profiled pair: within 0.5% of its wall time). A slow
    rank's ``rank_scale`` scales its compute, not its all-to-all.
    """

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    fb: float | None = None
    overlap: float = 1.0
    latency: float = 0.0
    stage_scale: tuple[float, ...] | None = None
    rank_scale: tuple[float, ...] | None = None
    stage_costs: tuple[tuple[float, float, float], ...] | None = None
    a2a_f: float = 0.0
    a2a_b: float = 0.0
    stage_a2a: tuple[tuple[float, float], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("a2a_f", "a2a_b"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= 1):
                raise ScheduleError(
                    f"cost {name} is a share of the pass's time: a number from 0 to 1, "
                    f"got {value}"
                )
        for name in ("f", "b", "w", "fb", "overlap", "latency"):
            value = getattr(self, name)
            if value is not None and not _in_range(value):
                label = name.upper() if len(name) < 3 else name
                raise ScheduleError(
                    f"cost {label} must be a finite number from 0 to {MAX_COST:g}, got {value}"
                )
        for name in ("stage_scale", "rank_scale"):
            values = getattr(self, name)
            if values is not None and not all(map(_in_range, values)):
                raise ScheduleError(
                    f"{name} must hold finite numbers from 0 to {MAX_COST:g}, got {values}"
                )
        if self.stage_costs is not None:
            if self.fb is not None or self.stage_scale is not None:
                raise ScheduleError(
                    "per-stage costs cannot be combined with FB or stage_scale: give the "
                    "overlap factor instead of FB, and fold the scales into the stage costs"
                )
            if _malformed(self.stage_costs, 3):
                raise ScheduleError(
                    f"each per-stage cost must be three times F, B, W, finite numbers from 0 "
                    f"to {MAX_COST:g}"
                )
        if self.stage_a2a is not None:
            self._check_stage_a2a()

    def _check_stage_a2a(self) -> None:
        if self.stage_costs is None or len(self.stage_a2a) != len(self.stage_costs):
            raise ScheduleError(
                "per-stage all-to-all times need per-stage compute costs, one pair (F's, "
                "B's) per stage: give stage_costs of the same length"
            )
        if self.a2a_f or self.a2a_b or self.overlap != 1.0:
            raise ScheduleError(
                "per-stage all-to-all times cost a pair by its streams: give them without "
                "the all-to-all shares (a2a_f, a2a_b) and the overlap factor"
            )
        if _malformed(self.stage_a2a, 2):
            raise ScheduleError(
                f"each per-stage all-to-all must be two times, F's and B's, from 0 to "
                f"{MAX_COST:g}"
            )

    @staticmethod
    def parse(text: str, latency: float = 0.0) -> CostModel:
        """Read ``F=1,B=1,W=1,FB=1.6`` (any subset; ``overlap=0.8``, ``a2a_f=0.6`` and
        ``a2a_b=0.5`` also accepted)."""
        fields: dict[str, float] = {}
        names = {"F": "f", "B": "b", "W": "w", "FB": "fb", "OVERLAP": "overlap"}
        names |= {"A2A_F": "a2a_f", "A2A_B": "a2a_b"}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key.strip().upper() not in names:
                raise ScheduleError(
                    f"cannot read cost {item!r}: write KEY=VALUE with KEY one of F, B, W, FB, "
                    "overlap, a2a_f, a2a_b, e.g. F=1,B=1,W=1,FB=1.6"
                )
            try:
                fields[names[key.strip().upper()]] = float(value)
            except ValueError:
                raise ScheduleError(f"cost {key} must be a number, got {value!r}") from None
        model = CostModel(latency=latency, **fields)
        if model.f + model.b + model.w == 0:
            raise ScheduleError(
                f"cost {text!r} gives F, B and W no time, so no schedule takes any: give at "
                "least one of them a positive time"
            )
        return model

    def per_stage(self, num_ranks: int, num_model_stages: int) -> CostModel:
        """Convert costs given for one rank's share of the model (one 1F1B stage) into
        costs of one stage of a model cut into ``num_model_stages`` stages."""
        factor = num_ranks / num_model_stages
        fb = None if self.fb is None else self.fb * factor
        return replace(self, f=self.f * factor, b=self.b * factor, w=self.w * factor, fb=fb)

    def _scale(self, stage: int, rank: int) -> float:
        scale = 1.0
        if self.stage_scale is not None:
            scale *= self.stage_scale[stage]
        if self.rank_scale is not None:
            scale *= self.rank_scale[rank]
        return scale

    def duration(self, action: Action, rank: int, model_stage: Callable[[int], int]) -> float:
        """How long a compute action takes on ``rank``; ``model_stage`` maps a stage to the
        part of the model it runs (for ``stage_scale``)."""
        if action.kind is Kind.FB:
            if self.stage_a2a is not None:  # the compute streams against the all-to-all's
                compute = sum(self.compute(h, rank, model_stage) for h in action.sub)
                return max(compute, sum(self._a2a(h, model_stage) for h in action.sub))
            if self.fb is not None:
                return self.fb * self._scale(model_stage(action.stage), rank)
            return self.overlap * sum(self.duration(h, rank, model_stage) for h in action.sub)
        if action.kind not in _PARTS:
            return 0.0
        stage = model_stage(action.stage)
        if self.stage_a2a is not None:
            return self.compute(action, rank, model_stage) + self._a2a(action, model_stage)
        if self.stage_costs is not None:
            costs, scale = self.stage_costs[stage], self._scale(stage, rank)
            return sum(costs[i] for i in _PARTS[action.kind]) * scale
        base = {Kind.F: self.f, Kind.B: self.b, Kind.W: self.w, Kind.BW: self.b + self.w}
        return base[action.kind] * self._scale(stage, rank)

    def compute(self, action: Action, rank: int, model_stage: Callable[[int], int]) -> float:
        """The compute in a compute action's time: F's and B's without their all-to-all
        share, W whole, an FB pair its halves' (what no schedule can hide)."""
        if action.kind is Kind.FB:
            return sum(self.compute(h, rank, model_stage) for h in action.sub)
        if action.kind not in _PARTS:
            return 0.0
        stage = model_stage(action.stage)
        if self.stage_costs is not None:
            parts = self.stage_costs[stage]
        else:
            parts = (self.f, self.b, self.w)
        compute = (1.0 - self.a2a_f, 1.0 - self.a2a_b, 1.0)  # (1, 1, 1) with stage_a2a
        own = sum(parts[i] * compute[i] for i in _PARTS[action.kind])
        return own * self._scale(stage, rank)

    def _a2a(self, action: Action, model_stage: Callable[[int], int]) -> float:
        """A plain F, B or BW's all-to-all under ``stage_a2a`` (W and others: none); the
        scales, which slow a rank's compute, leave it as it is."""
        side = 0 if action.kind is Kind.F else 1 if action.kind in (Kind.B, Kind.BW) else None
        if side is None:
            return 0.0
        return self.stage_a2a[model_stage(action.stage)][side]

    def check_fits(self, num_model_stages: int, num_ranks: int) -> None:
        """Raise if the per-stage or per-rank scales do not match the schedule."""
        if self.stage_costs is not None and len(self.stage_costs) != num_model_stages:
            raise ScheduleError(
                f"stage_costs has {len(self.stage_costs)} entries but the model has "
                f"{num_model_stages} stages"
            )
        if self.stage_scale is not None and len(self.stage_scale) != num_model_stages:
            raise ScheduleError(
                f"stage_scale has {len(self.stage_scale)} entries but the model has "
                f"{num_model_stages} stages"
            )
        if self.rank_scale is not None and len(self.rank_scale) != num_ranks:
            raise ScheduleError(
                f"rank_scale has {len(self.rank_scale)} entries but the schedule has "
                f"{num_ranks} ranks"
            )
