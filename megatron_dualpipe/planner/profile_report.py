"""The table ``simulate --profile --config`` prints: every schedule's step on a profile's
costs, against Megatron's interleaved 1F1B with its all-to-all overlap and torch's ZBV and
DualPipeV, and DualPipe's simulated bubble against DeepSeek's published formula. Pure
Python.

DeepSeek's DualPipe paper (Table 2) gives DualPipe's bubble as (PP/2 - 1)(F&B + B - 3W) for
one chunk's F, full backward B (dX + dW: the simulator's B + W), W (dW) and F&B (an
overlapped forward and full backward pair); the figure set beside it here is each rank's
simulated idle time (the step minus the rank's compute), on the same chunk costs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..schedules.ir import Action, Kind
from ..schedules.layout import format_layout
from ..schedules.simulate import SimResult
from .bound import step_bound
from .profile_config import ConfigCosts
from .report import markdown_table, spread

__all__ = ["PEERS", "ProfileRow", "deepseek_bubble", "profile_table"]

#: The schedules every row is set against.
PEERS = ("interleaved-1f1b-a2a", "torch-zbv", "torch-dualpipev")


@dataclass(frozen=True)
class ProfileRow:
    """One schedule's simulated step (ms) on the profile's costs; ``note`` where it does
    not apply. ``idle`` is each rank's idle time, ``exposed`` the all-to-all it waits for,
    ``bound`` the step's compute bound and ``split_bound`` its split's (:mod:`.bound`),
    ``chunk`` a middle stage's lone F, dX and W and ``pair`` its F&B pair (forward and full
    backward), as the cost model times them; ``fits``: its split is known to be within the
    memory cap (or none was given)."""

    schedule: str
    source: str
    stages: int | None = None
    split: str | None = None
    layout: str | None = None
    step: float | None = None
    bubble: float | None = None
    idle: tuple[float, ...] = ()
    exposed: tuple[float, ...] = ()
    bound: float | None = None
    split_bound: float | None = None
    chunk: tuple[float, float, float] | None = None
    pair: float | None = None
    note: str = ""
    fits: bool = True

    @staticmethod
    def of(name: str, source: str, result: SimResult, costs: ConfigCosts) -> ProfileRow:
        stages = len(costs.cost.stage_costs or ())
        chunk = pair = None
        if stages:
            middle = stages // 2

            def timed(action: Action) -> float:
                return costs.cost.duration(action, 0, lambda stage: stage)

            f, b, w = (Action(kind, middle, 0) for kind in (Kind.F, Kind.B, Kind.W))
            chunk = (timed(f), timed(b), timed(w))
            pair = timed(Action.overlapped(f, Action(Kind.BW, middle, 0)))
        bound = step_bound(result)
        return ProfileRow(
            name,
            source,
            stages=result.schedule.placement.num_model_stages,
            split=costs.split,
            layout=format_layout(list(costs.stages)),
            step=result.makespan,
            bubble=result.bubble_ratio,
            idle=tuple(r.idle for r in result.ranks),
            exposed=tuple(r.exposed for r in bound.ranks),
            bound=bound.bound,
            split_bound=bound.split_bound,
            chunk=chunk,
            pair=pair,
        )

    @property
    def overlaps(self) -> bool:
        """Whether its middle stage's F&B pair is shorter than its halves one after the
        other (by more than float rounding: a stage without all-to-all hides nothing)."""
        if self.pair is None or self.chunk is None:
            return False
        return self.pair < sum(self.chunk) * (1 - 1e-9)

    def to_json(self) -> dict:
        return {
            "schedule": self.schedule,
            "source": self.source,
            "model_stages": self.stages,
            "config_split": self.split == "config's" if self.split else None,
            "split": self.split,
            "layout": self.layout,
            "step_ms": self.step,
            "bubble_ratio": self.bubble,
            "idle_ms": list(self.idle),
            "exposed_a2a_ms": list(self.exposed),
            "compute_bound_ms": self.bound,
            "split_bound_ms": self.split_bound,
            "fits": self.fits,
            "note": self.note,
        }


def profile_table(rows: list[ProfileRow]) -> str:
    """A markdown table: a row per schedule, its step, its step over its compute bound
    and over its split's, bubble, idle and exposed all-to-all per rank and its step over
    each of :data:`PEERS`'."""
    steps = {r.schedule: r.step for r in rows if r.step is not None}
    header = ["schedule", "from", "stages", "split", "step (ms)", "bound (ms)", "vs bound"]
    header += ["split bound (ms)", "vs split bound"]
    header += ["bubble", "idle/rank (ms)", "exposed a2a/rank (ms)"]
    header += [f"vs {p}" for p in PEERS if p in steps]
    body = []
    for r in rows:
        if r.step is None:
            body.append(
                [r.schedule, r.source, "-", "-", "n/a"] + ["-"] * (len(header) - 5)
            )
            continue
        split = r.split or "-"
        bound = r.bound or 0.0
        line = [r.schedule, r.source, str(r.stages), split, f"{r.step:.1f}", f"{bound:.1f}"]
        line += [f"{r.step / bound:.3f}" if bound else "-"]
        split_bound = r.split_bound or 0.0
        line += [f"{split_bound:.1f}", f"{r.step / split_bound:.3f}" if split_bound else "-"]
        line += [f"{100 * (r.bubble or 0.0):.1f}%", spread(r.idle, 0), spread(r.exposed, 0)]
        line += [f"{r.step / steps[p]:.3f}" for p in PEERS if p in steps]
        body.append(line)
    text = markdown_table(header, body)
    notes = [
        f"- {'n/a: ' if r.step is None else ''}{r.schedule}: {r.note}" for r in rows if r.note
    ]
    return text + ("\n\n" + "\n".join(notes) if notes else "")


def deepseek_bubble(rows: list[ProfileRow], pp: int) -> dict | None:
    """DualPipe's bubble by DeepSeek's formula on a middle chunk's costs, beside its
    simulated idle per rank; None without a simulated dualpipe row."""
    row = next((r for r in rows if r.schedule == "dualpipe" and r.step is not None), None)
    if row is None or row.chunk is None or row.pair is None:
        return None
    f, b, w = row.chunk
    full = b + w  # the paper's B is the full backward
    pair = row.pair
    formula = (pp / 2 - 1) * (pair + full - 3 * w)
    mean = statistics.fmean(row.idle)
    line = (
        f"dualpipe bubble: DeepSeek's (PP/2-1)(F&B+B-3W) = ({pp}/2-1) x ({pair:.1f} + {full:.1f}"
        f" - 3 x {w:.1f}) = {formula:.1f} ms, on a middle chunk's F={f:.1f} B={full:.1f} (dX "
        f"{b:.1f} + dW) W={w:.1f} F&B={pair:.1f}; simulated idle per rank {mean:.1f} ms "
        f"({min(row.idle):.1f} to {max(row.idle):.1f})"
    )
    return {
        "pp": pp,
        "chunk_ms": {"F": f, "B_full": full, "dX": b, "W": w, "F&B": pair},
        "formula_ms": formula,
        "simulated_idle_ms": {"mean": mean, "min": min(row.idle), "max": max(row.idle)},
        "line": line,
    }
