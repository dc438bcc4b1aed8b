"""The simulated benchmark: every schedule (ours and torch's imported ones) through the same
simulator, on a grid of pipeline sizes, micro-batch counts and cost profiles.

Costs are per rank share (see :mod:`.catalog`), so all schedules run the same model. For
each (profile, PP, micro-batches) cell the rows are one per schedule plus a lower bound.
Imports only the schedule layer and ``bench.torch_schedules``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from ..schedules import ScheduleError, SimResult, simulate, validate
from .catalog import PROFILES, SCHEDULES, Profile, ScheduleEntry, per_stage_cost
from .tables import markdown_table

__all__ = [
    "BASELINE",
    "LOWER_BOUND",
    "MEGATRON_OVERLAP",
    "SimRow",
    "profile_by_key",
    "simulate_cell",
    "simulate_group",
    "peer_statements",
    "simulated_table",
]

#: The schedule "vs 1F1B" divides by.
BASELINE = "1f1b"
#: The name of the lower-bound row.
LOWER_BOUND = "lower bound"
#: The honest peer of our bidirectional schedules: Megatron's own F&B overlap.
MEGATRON_OVERLAP = "interleaved-1f1b-a2a"
#: The schedules compared with it.
BIDIRECTIONAL = ("dualpipe", "dualpipev")


@dataclass(frozen=True)
class SimRow:
    """One schedule in one grid cell. Times are in units of one rank share's forward.

    - ``makespan``: the simulated step; ``bubble_ratio``: idle over all ranks' time;
    - ``vs_1f1b``: makespan over our 1F1B's in the same cell;
    - ``peak_activations``: the most live activations on any rank, in units of one 1F1B
      stage's activations of one micro-batch (stage count x ranks / model stages);
    - ``param_factor``: parameters per rank over an even 1/PP share;
    - ``busiest``: the busiest rank's compute time (the makespan with no idle).

    The lower-bound row (``source`` "bound") has the least ``busiest`` of the cell's
    schedules as its makespan and no stages, activations or parameters. A schedule not
    legal in a cell has ``note`` set and no figures."""

    profile: str
    pp: int
    microbatches: int
    schedule: str
    source: str
    stages: int | None = None
    makespan: float | None = None
    bubble_ratio: float | None = None
    vs_1f1b: float | None = None
    peak_activations: float | None = None
    param_factor: float | None = None
    busiest: float | None = None
    note: str = ""


def _figures(result: SimResult) -> dict:
    p = result.schedule.placement
    stage_size = p.num_ranks / p.num_model_stages
    return {
        "stages": p.num_stages,
        "makespan": result.makespan,
        "bubble_ratio": result.bubble_ratio,
        "peak_activations": max(r.peak_activations for r in result.ranks) * stage_size,
        "param_factor": result.param_factor,
        "busiest": max(r.busy for r in result.ranks),
    }


def simulate_cell(
    profile: Profile,
    pp: int,
    microbatches: int,
    schedules: Sequence[ScheduleEntry] = SCHEDULES,
    latency: float = 0.0,
) -> list[SimRow]:
    """Build, validate and simulate each schedule at (``pp``, ``microbatches``) under
    ``profile`` (plus ``latency`` per hop); rows in ``schedules`` order, then the bound."""
    figures: dict[str, dict] = {}
    notes: dict[str, str] = {}
    cost = replace(profile.cost, latency=latency)
    for entry in schedules:
        try:
            schedule = entry.build(pp, microbatches)
            validate(schedule)
        except ScheduleError as err:
            notes[entry.name] = str(err)
            continue
        figures[entry.name] = _figures(simulate(schedule, per_stage_cost(cost, schedule)))
    base = figures.get(BASELINE, {}).get("makespan")

    def ratio(makespan: float) -> float | None:
        return makespan / base if base else None

    rows = [
        SimRow(profile.key, pp, microbatches, e.name, e.source, note=notes[e.name])
        if e.name in notes
        else SimRow(
            profile.key,
            pp,
            microbatches,
            e.name,
            e.source,
            vs_1f1b=ratio(figures[e.name]["makespan"]),
            **figures[e.name],
        )
        for e in schedules
    ]
    if figures:
        bound = min(f["busiest"] for f in figures.values())
        rows.append(
            SimRow(
                profile.key,
                pp,
                microbatches,
                LOWER_BOUND,
                "bound",
                makespan=bound,
                bubble_ratio=0.0,
                vs_1f1b=ratio(bound),
                busiest=bound,
            )
        )
    return rows


def simulate_group(
    profile: Profile,
    pp: int,
    microbatch_counts: Iterable[int],
    schedules: Sequence[ScheduleEntry] = SCHEDULES,
    latency: float = 0.0,
    progress: Callable[[str], None] | None = None,
) -> list[SimRow]:
    """:func:`simulate_cell` for each micro-batch count; ``progress`` gets one line per
    cell."""
    rows: list[SimRow] = []
    for m in microbatch_counts:
        start = time.perf_counter()
        cell = simulate_cell(profile, pp, m, schedules, latency)
        rows += cell
        if progress:
            done = sum(r.makespan is not None for r in cell if r.source != "bound")
            progress(
                f"  simulated {profile.label:<15} PP={pp:<2} micro-batches={m:<3} "
                f"{done} schedules in {time.perf_counter() - start:.2f} s"
            )
    return rows


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def simulated_table(rows: Sequence[SimRow], profile: Profile | None = None) -> str:
    """One markdown table for rows of one (profile, PP): a row per schedule; per
    micro-batch count its makespan, bubble ratio and ratio to 1F1B; peak activations are
    the largest over the micro-batch counts."""
    if not rows:
        return ""
    label = profile.label if profile else rows[0].profile
    counts = sorted({r.microbatches for r in rows})
    names = list(dict.fromkeys(r.schedule for r in rows))
    by_key = {(r.schedule, r.microbatches): r for r in rows}
    header = ["schedule", "from", "stages", "params", "peak act."]
    for m in counts:
        header += [f"T m={m}", "bubble", "vs 1F1B"]
    body = []
    for name in names:
        cells = [by_key[(name, m)] for m in counts if (name, m) in by_key]
        first = cells[0]
        peaks = [c.peak_activations for c in cells if c.peak_activations is not None]
        line = [
            name,
            first.source,
            _num(first.stages, "d"),
            _num(first.param_factor, "g", "x"),
            _num(max(peaks) if peaks else None, "g"),
        ]
        for m in counts:
            c = by_key.get((name, m))
            if c is None or c.makespan is None:
                line += ["n/a", "-", "-"]
            else:
                line += [
                    _num(c.makespan, ".1f"),
                    _num(100 * c.bubble_ratio, ".1f", "%"),
                    _num(c.vs_1f1b, ".3f"),
                ]
        body.append(line)
    title = f"**{label}, PP={rows[0].pp}** (T in units of one rank share's F)"
    notes = sorted({f"{r.schedule} at m={r.microbatches}: {r.note}" for r in rows if r.note})
    text = title + "\n\n" + markdown_table(header, body)
    if notes:
        text += "\n\n" + "\n".join(f"- n/a: {n}" for n in notes)
    statements = peer_statements(rows)
    if statements:
        text += "\n\n" + "\n".join(f"- {s}" for s in statements)
    return text


def peer_statements(rows: Sequence[SimRow]) -> list[str]:
    """For dualpipe and dualpipev: their step over Megatron's interleaved 1F1B with
    all-to-all overlap, per micro-batch count, and whether they are ahead of it."""
    by_key = {(r.schedule, r.microbatches): r for r in rows if r.makespan is not None}
    statements = []
    for name in BIDIRECTIONAL:
        ratios = {
            m: by_key[(name, m)].makespan / by_key[(MEGATRON_OVERLAP, m)].makespan
            for (n, m) in sorted(by_key)
            if n == name and (MEGATRON_OVERLAP, m) in by_key
        }
        if not ratios:
            continue
        figures = ", ".join(f"{r:.3f} at m={m}" for m, r in ratios.items())
        behind = [m for m, r in ratios.items() if r >= 1.0]
        verdict = (
            f"not ahead at m={', '.join(map(str, behind))}" if behind else "ahead at every m"
        )
        statements.append(f"{name} / Megatron's {MEGATRON_OVERLAP}: {figures} ({verdict})")
    return statements


def profile_by_key(key: str) -> Profile:
    """The profile in :data:`PROFILES` with ``key``."""
    for p in PROFILES:
        if p.key == key:
            return p
    raise KeyError(key)
