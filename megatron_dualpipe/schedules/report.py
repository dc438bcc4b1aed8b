"""Plain-text tables of simulation results, for the command line."""

from __future__ import annotations

from .simulate import SimResult

__all__ = ["comparison_table", "rank_table"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def rank_table(result: SimResult) -> str:
    """Per-rank busy and idle time, bubble ratio and peak live activations."""
    bound = result.schedule.activation_bound
    rows = [
        [
            str(r.rank),
            f"{r.busy:.2f}",
            f"{r.idle:.2f}",
            f"{100 * r.bubble_ratio:.1f}%",
            str(r.peak_activations),
            str(bound[r.rank]) if bound else "-",
        ]
        for r in result.ranks
    ]
    header = ["rank", "busy", "idle", "bubble", "peak act.", "bound"]
    sched = result.schedule
    summary = (
        f"{sched.name}: PP={sched.num_ranks} micro-batches={sched.num_microbatches} "
        f"stages={sched.placement.num_stages} makespan={result.makespan:.2f} "
        f"bubble={100 * result.bubble_ratio:.1f}% params/rank={result.param_factor:g}x"
    )
    return summary + "\n" + _table(header, rows)


def _stage_size(result: SimResult) -> float:
    """One stage's size as a fraction of one rank's share of the model."""
    p = result.schedule.placement
    return p.num_ranks / p.num_model_stages


def comparison_table(results: list[SimResult], skipped: dict[str, str]) -> str:
    """One row per schedule, with makespan relative to the first (normally 1F1B)."""
    base = results[0].makespan if results else 0.0
    rows = []
    for r in results:
        idle = [x.bubble_ratio for x in r.ranks]
        rows.append(
            [
                r.schedule.name,
                str(r.schedule.placement.num_stages),
                f"{r.makespan:.2f}",
                f"{r.makespan / base:.3f}" if base else "-",
                f"{100 * r.bubble_ratio:.1f}%",
                f"{100 * min(idle):.1f}-{100 * max(idle):.1f}%",
                str(max(x.peak_activations for x in r.ranks)),
                f"{max(x.peak_activations for x in r.ranks) * _stage_size(r):g}",
                f"{r.param_factor:g}x",
            ]
        )
    header = [
        "schedule",
        "stages",
        "makespan",
        f"vs {results[0].schedule.name}" if results else "ratio",
        "bubble",
        "bubble/rank",
        "peak act.",
        "act. memory",
        "params/rank",
    ]
    text = _table(header, rows)
    text += (
        "\npeak act.: in stages x micro-batches; act. memory: the same in units of one "
        "1F1B stage's activations of one micro-batch (a model cut into more stages has "
        "smaller ones)"
    )
    for name, reason in skipped.items():
        text += f"\n{name}: not simulated: {reason}"
    return text
