"""The simulated benchmark: every schedule (ours and torch's imported ones) through the same
simulator, on a grid of pipeline sizes, micro-batch counts and cost profiles.

Costs are per rank share (see :mod:`.profiles`), so all
schedules run the same model. For each (profile, PP, micro-batches) cell the rows are one
per schedule, then, if asked, the optimiser's rows (:data:`OPTIMISED`), then a lower bound.
Each schedule's step is also set against its compute bound
(:func:`megatron_dualpipe.planner.bound.step_bound`). Imports only the schedule layer and
the planner: its pure-Python bound, tables, catalog and torch's schedules (the optimiser,
with SciPy, only when asked for).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from megatron_dualpipe.planner.bound import step_bound
from megatron_dualpipe.planner.optimize import (
    Effort,  # the optimiser imports SciPy only when it runs
)
from megatron_dualpipe.planner.report import markdown_table, spread
from megatron_dualpipe.planner.schedule_catalog import SCHEDULES, ScheduleEntry
from megatron_dualpipe.schedules import Schedule, ScheduleError, SimResult, simulate, validate

from .profiles import PROFILES, Profile

__all__ = [
    "BASELINE",
    "LOWER_BOUND",
    "MEGATRON_OVERLAP",
    "OPTIMISED",
    "OPTIMISER_EFFORT",
    "OPTIMISER_SECONDS",
    "OPTIMISED_UP_TO",
    "SimRow",
    "compute_bound_line",
    "optimiser_table",
    "peer_statements",
    "profile_by_key",
    "simulate_cell",
    "simulate_group",
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
#: Optimiser rows: (row name, the hand-made schedule whose placement kind it optimises).
#: Each runs on every placement of that kind in the cell (a loop: one and two stages per
#: rank) and keeps the faster.
OPTIMISED: tuple[tuple[str, str], ...] = (
    ("dualpipev-opt", "dualpipev"),
    ("zb1p-opt", "zb1p"),
    ("dualpipe-opt", "dualpipe"),
)
#: The optimiser's budget per placement and memory cap in the grid: a fixed amount of work,
#: so that the table is the same on any machine under any load ...
OPTIMISER_EFFORT = Effort()
#: ... and a time limit (seconds) that only stops a search the machine cannot finish.
OPTIMISER_SECONDS = 60.0
#: The optimiser rows run up to this many micro-batches per rank (the 2PP and 4PP grid).
OPTIMISED_UP_TO = 4


@dataclass(frozen=True)
class SimRow:
    """One schedule in one grid cell. Times are in units of one rank share's forward.

    - ``makespan``: the simulated step; ``bubble_ratio``: idle over all ranks' time;
    - ``vs_1f1b``: makespan over our 1F1B's in the same cell;
    - ``compute_bound``: the step's compute bound (:func:`..planner.bound.step_bound` of
      the same simulation: every pass's compute without its all-to-all, shared evenly over
      the ranks); ``vs_bound``: makespan over it;
    - ``peak_activations``: the most live activations on any rank, in units of one 1F1B
      stage's activations of one micro-batch (stage count x ranks / model stages);
    - ``param_factor``: parameters per rank over an even 1/PP share;
    - ``busiest``: the busiest rank's compute time (the makespan with no idle);
    - ``bubble_removed``: (1F1B's makespan - makespan) / 1F1B's bubble (its makespan
      minus its busiest rank's compute), in the same cell.

    Optimiser rows (``source`` "optimised") also have ``memory_cap`` (activations per
    rank, in the placement's stages), the proven ``proven_bound`` on any schedule of
    their placement, ``gap`` = (makespan - bound) / makespan and ``solve_seconds``. The
    lower-bound row (``source`` "bound") has the least ``busiest`` of the cell's
    schedules as its makespan and no stages, activations, parameters or compute bound
    (it is not a schedule's step). A schedule not
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
    compute_bound: float | None = None
    vs_bound: float | None = None
    peak_activations: float | None = None
    param_factor: float | None = None
    busiest: float | None = None
    bubble_removed: float | None = None
    memory_cap: int | None = None
    proven_bound: float | None = None
    gap: float | None = None
    solve_seconds: float | None = None
    note: str = ""


def _figures(result: SimResult) -> dict:
    """A simulated schedule's :class:`SimRow` figures that need no other row."""
    p = result.schedule.placement
    stage_size = p.num_ranks / p.num_model_stages
    bound = step_bound(result)
    return {
        "stages": p.num_stages,
        "makespan": result.makespan,
        "bubble_ratio": result.bubble_ratio,
        "compute_bound": bound.bound,
        "vs_bound": bound.ratio,
        "peak_activations": max(r.peak_activations for r in result.ranks) * stage_size,
        "param_factor": result.param_factor,
        "busiest": max(r.busy for r in result.ranks),
    }


def simulate_cell(
    profile: Profile,
    pp: int,
    microbatches: int,
    schedules: Sequence[ScheduleEntry] = SCHEDULES,
    latency: float | None = None,
    optimise: bool = False,
    time_limit: float = OPTIMISER_SECONDS,
    effort: Effort | None = OPTIMISER_EFFORT,
) -> list[SimRow]:
    """Build, validate and simulate each schedule at (``pp``, ``microbatches``) under
    ``profile`` (with ``latency`` per hop instead of the profile's, if given); rows in
    ``schedules`` order, then with ``optimise`` the :data:`OPTIMISED` rows (each search
    within ``effort`` and ``time_limit``), then the bound."""
    if latency is not None:
        profile = replace(profile, cost=replace(profile.cost, latency=latency))
    figures: dict[str, dict] = {}
    built: dict[str, Schedule] = {}
    notes: dict[str, str] = {}
    for entry in schedules:
        try:
            schedule = entry.build(pp, microbatches)
            validate(schedule)
        except ScheduleError as err:
            notes[entry.name] = str(err)
            continue
        built[entry.name] = schedule
        figures[entry.name] = _figures(simulate(schedule, profile.cost_for(schedule.placement)))
    rows = [
        SimRow(profile.key, pp, microbatches, e.name, e.source, note=notes[e.name])
        if e.name in notes
        else SimRow(profile.key, pp, microbatches, e.name, e.source, **figures[e.name])
        for e in schedules
    ]
    if optimise:
        rows += _optimised_rows(profile, pp, microbatches, built, figures, time_limit, effort)
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
                busiest=bound,
            )
        )
    base = figures.get(BASELINE)
    return [_against(row, base) for row in rows]


def _against(row: SimRow, base: dict | None) -> SimRow:
    """``row`` with its ratio to 1F1B and the share of 1F1B's bubble it removes."""
    if base is None or row.makespan is None:
        return row
    bubble = base["makespan"] - base["busiest"]
    removed = (base["makespan"] - row.makespan) / bubble if bubble > 0 else None
    return replace(row, vs_1f1b=row.makespan / base["makespan"], bubble_removed=removed)


def _holder(peers: list[str], figures: dict[str, dict], level: float) -> str:
    """The first schedule (in table order) whose peak activations are ``level``."""
    return next(n for n in peers if abs(figures[n]["peak_activations"] - level) < 1e-9)


def _optimised_rows(
    profile: Profile,
    pp: int,
    microbatches: int,
    built: dict[str, Schedule],
    figures: dict[str, dict],
    time_limit: float,
    effort: Effort | None,
) -> list[SimRow]:
    """For each :data:`OPTIMISED` entry: the optimiser on its placement kind, first under
    the least peak activations among the cell's schedules of that kind (so it holds no
    more than any of them), then, only where a schedule of that kind holding more is
    still faster, under that schedule's peak (a row named after the schedule whose memory
    it is given)."""
    from megatron_dualpipe.planner.optimize import optimize_on_placements  # imports SciPy

    rows = []
    for name, hand in OPTIMISED:
        if hand not in built:
            rows.append(
                SimRow(profile.key, pp, microbatches, name, "optimised", note=f"{hand} is n/a")
            )
            continue
        kind = built[hand].placement.kind
        peers = [n for n, s in built.items() if s.placement.kind == kind]
        levels = sorted({figures[n]["peak_activations"] for n in peers})
        done: list[tuple[float, float]] = []
        for i, level in enumerate(levels):
            unbeaten = [
                n
                for n in peers
                if figures[n]["peak_activations"] <= level + 1e-9
                and not any(
                    t <= figures[n]["makespan"] + 1e-9
                    and peak <= figures[n]["peak_activations"] + 1e-9
                    for t, peak in done
                )
            ]
            if i and not unbeaten:
                continue
            best = optimize_on_placements(
                [built[n] for n in peers],
                profile.cost_for,
                level,
                time_limit=time_limit,
                effort=effort,
            )
            row = SimRow(
                profile.key,
                pp,
                microbatches,
                name if not i else f"{name}, {_holder(peers, figures, level)}'s memory",
                "optimised",
                memory_cap=best.caps[0],
                proven_bound=best.lower_bound,
                gap=best.gap,
                solve_seconds=best.solve_seconds,
                **_figures(best.result),
            )
            rows.append(row)
            done.append((row.makespan, row.peak_activations))
    return rows


def simulate_group(
    profile: Profile,
    pp: int,
    microbatch_counts: Iterable[int],
    schedules: Sequence[ScheduleEntry] = SCHEDULES,
    latency: float | None = None,
    progress: Callable[[str], None] | None = None,
    optimise: bool = False,
    time_limit: float = OPTIMISER_SECONDS,
    effort: Effort | None = OPTIMISER_EFFORT,
) -> list[SimRow]:
    """:func:`simulate_cell` for each micro-batch count (with ``optimise``, the optimiser
    rows up to :data:`OPTIMISED_UP_TO` x ``pp`` micro-batches); ``progress`` gets one line
    per cell."""
    rows: list[SimRow] = []
    for m in microbatch_counts:
        start = time.perf_counter()
        here = optimise and m <= OPTIMISED_UP_TO * pp
        cell = simulate_cell(profile, pp, m, schedules, latency, here, time_limit, effort)
        rows += cell
        if progress:
            done = sum(
                r.makespan is not None for r in cell if r.source not in ("bound", "optimised")
            )
            opt = [r for r in cell if r.source == "optimised" and r.makespan is not None]
            extra = f", {len(opt)} optimised" if opt else ""
            progress(
                f"  simulated {profile.label:<19} PP={pp:<2} micro-batches={m:<3} "
                f"{done} schedules{extra} in {time.perf_counter() - start:.2f} s"
            )
    return rows


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def simulated_table(rows: Sequence[SimRow], profile: Profile | None = None) -> str:
    """One markdown table for rows of one (profile, PP): a row per schedule; per
    micro-batch count its makespan, bubble ratio, ratio to 1F1B, step over its compute
    bound (``1.38x``; "-" on the lower-bound row) and share of 1F1B's bubble removed; peak
    activations are the largest over the micro-batch counts. Under it: the n/a notes, the
    compute bound per micro-batch count (:func:`compute_bound_line`) and the peer
    statements."""
    if not rows:
        return ""
    label = profile.label if profile else rows[0].profile
    counts = sorted({r.microbatches for r in rows})
    names = list(dict.fromkeys(r.schedule for r in rows))
    by_key = {(r.schedule, r.microbatches): r for r in rows}
    header = ["schedule", "from", "stages", "params", "peak act."]
    for m in counts:
        header += [f"T m={m}", "bubble", "vs 1F1B", "vs compute bound"]
        header += ["bubble removed vs 1F1B"]
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
                line += ["n/a", "-", "-", "-", "-"]
            else:
                removed = None if c.bubble_removed is None else 100 * c.bubble_removed
                line += [
                    _num(c.makespan, ".2f"),
                    _num(100 * c.bubble_ratio, ".1f", "%"),
                    _num(c.vs_1f1b, ".3f"),
                    _num(c.vs_bound, ".2f", "x"),
                    _num(removed, ".0f", "%"),
                ]
        body.append(line)
    title = f"**{label}, PP={rows[0].pp}** (T in units of one rank share's F)"
    notes = sorted({f"{r.schedule} at m={r.microbatches}: {r.note}" for r in rows if r.note})
    text = title + "\n\n" + markdown_table(header, body)
    if notes:
        text += "\n\n" + "\n".join(f"- n/a: {n}" for n in notes)
    bound = compute_bound_line(rows)
    statements = ([bound] if bound else []) + peer_statements(rows)
    if statements:
        text += "\n\n" + "\n".join(f"- {s}" for s in statements)
    return text


def compute_bound_line(rows: Sequence[SimRow]) -> str:
    """Per micro-batch count, the compute bound of the rows that have one (T): its mean
    over them and its range (:func:`..planner.report.spread`). Where the ends cost more,
    the schedules' bounds differ: one that cuts the model into more stages makes its
    heavier ends a smaller part of it. Empty where no row has a bound."""
    bounds: dict[int, list[float]] = {}
    for r in rows:
        if r.compute_bound is not None:
            bounds.setdefault(r.microbatches, []).append(r.compute_bound)
    if not bounds:
        return ""
    figures = ", ".join(f"{spread(b)} at m={m}" for m, b in sorted(bounds.items()))
    return f"compute bound (T; mean over the schedules, range): {figures}"


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
        verdict = f"not ahead at m={', '.join(map(str, behind))}" if behind else "ahead at every m"
        statements.append(f"{name} / Megatron's {MEGATRON_OVERLAP}: {figures} ({verdict})")
    return statements


def optimiser_table(rows: Sequence[SimRow]) -> str:
    """One markdown table of the optimiser rows: per (profile, row) and (PP, micro-batches)
    its proven gap, and its solve time in brackets; ``*`` marks a gap within 1%."""
    opt = [r for r in rows if r.source == "optimised" and r.gap is not None]
    if not opt:
        return ""
    cells = sorted({(r.pp, r.microbatches) for r in opt})
    header = ["profile", "row"] + [f"PP={pp} m={m}" for pp, m in cells]
    keys = list(dict.fromkeys((r.profile, r.schedule) for r in opt))
    by_key = {(r.profile, r.schedule, r.pp, r.microbatches): r for r in opt}
    body = []
    for profile, name in keys:
        line = [profile, name]
        for pp, m in cells:
            r = by_key.get((profile, name, pp, m))
            if r is None:
                line.append("-")
            else:
                mark = "*" if r.gap <= 0.01 else ""
                line.append(f"{100 * r.gap:.2f}%{mark} ({r.solve_seconds:.1f} s)")
        body.append(line)
    return markdown_table(header, body)


def profile_by_key(key: str) -> Profile:
    """The profile in :data:`PROFILES` with ``key``."""
    for p in PROFILES:
        if p.key == key:
            return p
    raise KeyError(key)
