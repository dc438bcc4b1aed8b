"""Figures of an optimisation for people: before and after, against 1F1B, with the proof."""

from __future__ import annotations

from collections.abc import Callable

from ...schedules.cost import CostModel
from ...schedules.ir import Schedule
from ...schedules.registry import generate
from ...schedules.simulate import SimResult, simulate
from ..report import rank_table, text_table
from .optimizer import OptimizeResult, optimize

__all__ = ["against_1f1b", "bubble_removed", "heading", "summary", "summary_json"]


def bubble_removed(makespan: float, reference: SimResult) -> float | None:
    """The step time a schedule saves against ``reference`` (1F1B on the same model and
    micro-batches) as a share of the reference's bubble: its makespan minus its busiest
    rank's compute. 1.0: all of 1F1B's bubble gone; above 1.0: also less compute (FB
    overlap). None where the reference has no bubble."""
    busiest = max(r.busy for r in reference.ranks)
    bubble = reference.makespan - busiest
    if bubble <= 0:
        return None
    return (reference.makespan - makespan) / bubble


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def summary(result: OptimizeResult, reference: SimResult) -> str:
    """Before (the best hand-made schedule) and after, side by side, then the bound, the
    proven gap and the solve time."""
    before, after = result.baseline_result, result.result

    def column(r: SimResult) -> list[str]:
        return [
            f"{r.makespan:.4g}",
            _pct(r.bubble_ratio),
            str(max(x.peak_activations for x in r.ranks)),
            _pct(bubble_removed(r.makespan, reference)),
        ]

    names = ["makespan", "bubble", "peak act.", "bubble removed vs 1F1B"]
    rows = [[name, b, a] for name, b, a in zip(names, column(before), column(after), strict=True)]
    head = ["", f"hand-made ({result.baseline.name})", f"optimised ({result.schedule.name})"]
    cap = result.caps[0] if len(set(result.caps)) == 1 else list(result.caps)
    lines = [
        text_table(head, rows),
        f"lower bound {result.lower_bound:.4g}: no schedule of this placement under these "
        f"costs is faster (rank {result.bound.rank}'s relaxation, "
        f"{result.bound.methods[result.bound.rank]}; the memory cap is not part of it)",
        f"proven gap {100 * result.gap:.2f}% (the optimum is at most that much below the "
        f"result); memory cap {cap} activations per rank; solve {result.solve_seconds:.2f} s",
    ]
    if result.cut:
        lines.append(
            f"the time limit ({result.time_limit:g} s) cut the search short: "
            f"{', '.join(result.cut)}; the search stopped after {result.search_seconds:.2f} s "
            f"and validating and simulating the result took "
            f"{result.solve_seconds - result.search_seconds:.2f} s more"
        )
    if result.fell_back:
        lines.append(
            f"nothing faster than {result.baseline.name} within the cap was found: the result "
            "is that schedule"
        )
    return "\n".join(lines)


def summary_json(result: OptimizeResult, reference: SimResult) -> dict:
    """What ``simulate --optimize --json`` adds to the simulation's figures."""
    return {
        "optimized": True,
        "baseline": result.baseline.name,
        "baseline_makespan": result.baseline_result.makespan,
        "lower_bound": result.lower_bound,
        "gap": result.gap,
        "solve_seconds": result.solve_seconds,
        "memory_cap": list(result.caps),
        "fell_back": result.fell_back,
        "time_limit_cut": list(result.cut),
        "search_seconds": result.search_seconds,
        "bubble_removed_vs_1f1b": bubble_removed(result.makespan, reference),
    }


def heading(base: Schedule, time_limit: float) -> str:
    """The line ``simulate --optimize`` prints before the search."""
    p = base.placement
    return (
        f"optimising the {p.kind} placement of {base.name}: PP={p.num_ranks} "
        f"micro-batches={p.num_microbatches} stages={p.num_stages}, time limit "
        f"{time_limit:g} s"
    )


def against_1f1b(
    base: Schedule,
    cost_for: Callable[[Schedule], CostModel],
    *,
    memory_cap: int | None,
    time_limit: float,
    warm_start: bool,
    progress: Callable[[str], None] | None = None,
    timeline: bool = False,
) -> tuple[OptimizeResult, str, dict]:
    """Optimise ``base``'s placement (from ``base`` itself too where ``warm_start``; else
    ``base`` is the generated schedule, not generated again) on the cost model ``cost_for``
    gives a schedule; the result (every action's times kept only with ``timeline``), its
    summary and per-rank table against 1F1B on the same ranks and micro-batches, and
    :func:`summary_json`."""
    p = base.placement
    result = optimize(
        p,
        cost_for(base),
        memory_cap=memory_cap,
        time_limit=time_limit,
        warm_starts=[base.compute_only()] if warm_start else (),
        progress=progress,
        generated=() if warm_start else [base],
        timeline=timeline,
    )
    one_f_one_b = generate("1f1b", p.num_ranks, p.num_microbatches)
    reference = simulate(one_f_one_b, cost_for(one_f_one_b), timeline=False)
    text = f"{summary(result, reference)}\n{rank_table(result.result)}"
    return result, text, summary_json(result, reference)
