"""A measured training step beside the simulator's: the prediction for the order the ranks
ran with their measured mean durations, the end-of-run summary (each pipeline rank's busy
time and bubble, measured and simulated) and the picture (the measured step above the
prediction), for ``train``'s ``pipeline_timeline``. Pure Python; matplotlib and numpy are
imported to draw."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from ..schedules.ir import Kind, Schedule
from ..schedules.simulate import SimResult, simulate
from .bound import step_bound
from .export import figure_width, to_png

__all__ = [
    "CAPTION",
    "StepSummary",
    "measured_stage_costs",
    "placement_note",
    "predict",
    "report_measured_step",
    "summary_lines",
    "write_side_by_side_png",
]


#: The line under the timeline: why the measured bubble is not the simulated one.
CAPTION = (
    "Why the bubbles differ: the simulation gives every action its stage's mean measured "
    "time and sends messages instantly; the measured step also waits between actions "
    "(messages, Python) and its times vary."
)


def write_side_by_side_png(measured: SimResult, predicted: SimResult, path: Path) -> None:
    """One PNG: the measured step on top, the simulator's prediction below on the same
    time scale (ms), and :data:`CAPTION` under them."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.image import imread, imsave

    span = max(measured.makespan, predicted.makespan)
    shortest = min(
        (t.end - t.start for r in (*measured.ranks, *predicted.ranks) for t in r.actions),
        default=span,
    )
    width = figure_width(span, max(shortest, span * 1e-3))
    parts = []
    for result, title in (
        (measured, f"{measured.schedule.name}: measured step"),
        (predicted, f"{predicted.schedule.name}: simulated with the measured mean durations"),
    ):
        part = path.with_name(f".{path.stem}.{len(parts)}.png")
        to_png(result, str(part), title=title, unit="ms", span=span, width=width)
        parts.append(imread(part))
        part.unlink()
    caption = Figure(figsize=(width, 0.4), dpi=parts[0].shape[1] / width)
    FigureCanvasAgg(caption)
    size = min(11.0, 0.9 * width * 72 / (0.5 * len(CAPTION)))  # one line across the width
    caption.text(0.5, 0.5, CAPTION, ha="center", va="center", fontsize=size)
    part = path.with_name(f".{path.stem}.caption.png")
    caption.savefig(part)
    parts.append(imread(part))
    part.unlink()
    columns = max(p.shape[1] for p in parts)
    padded = [
        np.pad(p, ((0, 0), (0, columns - p.shape[1]), (0, 0)), constant_values=1.0) for p in parts
    ]
    imsave(path, np.concatenate(padded, axis=0))


def measured_stage_costs(measured: SimResult) -> tuple[tuple[float, float, float], ...] | None:
    """Each model stage's mean measured F, B (dX) and W times, in model-stage order (a full
    backward that ran as one counts as B, its W 0); None when some stage ran no forward or
    no backward outside FB pairs. Stages differ: the first holds the embedding, the last
    the output layer and the loss."""
    placement = measured.schedule.placement
    times: dict[tuple[int, Kind], list[float]] = {}
    for rank in measured.ranks:
        for timed in rank.actions:
            key = (placement.model_stage(timed.action.stage), timed.action.kind)
            times.setdefault(key, []).append(timed.end - timed.start)

    def mean(stage: int, kind: Kind) -> float | None:
        found = times.get((stage, kind))
        return statistics.fmean(found) if found else None

    costs = []
    for stage in range(placement.num_model_stages):
        f, b, w = (mean(stage, kind) for kind in (Kind.F, Kind.B, Kind.W))
        if b is None and w is None:
            b, w = mean(stage, Kind.BW), 0.0
        if f is None or b is None:
            return None
        costs.append((f, b, w or 0.0))
    return tuple(costs)


def predict(measured: SimResult) -> SimResult:
    """The simulator's step for the order the ranks ran and the measured mean durations of
    each model stage (:func:`measured_stage_costs`; of each kind where a stage's are not all
    measured): the measured schedule's, with each FB that ran as its two halves one after
    the other (not interleaved) as those two halves, so that the prediction draws what
    ran. An FB pair that ran as one takes the measured ratio of FB to F + B."""
    schedule, cost = measured.schedule, measured.cost
    per_stage = measured_stage_costs(measured)
    if per_stage is not None:
        overlap = 1.0 if cost.fb is None or not cost.f + cost.b else cost.fb / (cost.f + cost.b)
        cost = replace(cost, fb=None, overlap=overlap, stage_costs=per_stage)
    ran = [[timed.action for timed in rank.actions] for rank in measured.ranks]
    return simulate(Schedule(schedule.name, schedule.placement, ran), cost)


@dataclass(frozen=True)
class StepSummary:
    """The measured step: per pipeline rank its busy time (ms), measured bubble ratio and
    the simulator's bubble ratio for the same schedule and mean action durations."""

    iteration: int
    schedule: str
    microbatches: int
    makespan_ms: float
    busy_ms: tuple[float, ...]
    bubble: tuple[float, ...]
    simulated_bubble: tuple[float, ...]
    png: str | None
    #: Why one rank is the long one, where the placement of the end stages makes it so.
    placement_note: str | None = None
    #: The compute bound of the measured costs (ms): every rank's measured F, B and W
    #: compute shared evenly over the ranks (:func:`~.bound.step_bound` of the prediction).
    bound_ms: float | None = None
    simulated_ms: float | None = None

    @staticmethod
    def of(
        iteration: int, measured: SimResult, predicted: SimResult, png: str | None
    ) -> StepSummary:
        return StepSummary(
            iteration=iteration,
            schedule=measured.schedule.name,
            microbatches=measured.schedule.num_microbatches,
            makespan_ms=measured.makespan,
            busy_ms=tuple(r.busy for r in measured.ranks),
            bubble=tuple(r.bubble_ratio for r in measured.ranks),
            simulated_bubble=tuple(r.bubble_ratio for r in predicted.ranks),
            png=png,
            placement_note=placement_note(predicted),
            bound_ms=step_bound(predicted).bound,
            simulated_ms=predicted.makespan,
        )


#: What the first and the last model stage hold beside their layers.
_END_STAGE_PARTS = ("the embedding", "the output layer and the loss")
#: How much longer than the mean a rank's busy time (and an end stage's time) must be to
#: name the placement as the cause.
_LONGER = 1.05


def placement_note(predicted: SimResult) -> str | None:
    """A footnote when the placement makes a rank the long one: in the simulated step (each
    model stage its own measured times) the busiest rank is busier than the mean rank and
    holds the first or the last model stage, whose embedding or output layer and loss make
    it costlier than the mean stage; None otherwise."""
    costs = predicted.cost.stage_costs
    if costs is None:
        return None
    placement = predicted.schedule.placement
    busy = [r.busy for r in predicted.ranks]
    rank = max(range(len(busy)), key=busy.__getitem__)
    totals = [sum(c) for c in costs]
    mean_stage = math.fsum(totals) / len(totals)
    if busy[rank] <= _LONGER * math.fsum(busy) / len(busy):
        return None
    ends = {0: _END_STAGE_PARTS[0], len(costs) - 1: _END_STAGE_PARTS[1]}
    stages = range(placement.num_stages)
    held = sorted({placement.model_stage(s) for s in stages if placement.rank_of(s) == rank})
    heavy = [s for s in held if s in ends and totals[s] > _LONGER * mean_stage]
    if not heavy:
        return None
    parts = " and ".join(ends[s] for s in heavy)
    times = ", ".join(f"stage {s} {totals[s] / mean_stage:.2f}x" for s in heavy)
    return (
        f"pipeline rank {rank} is the long one because {predicted.schedule.name} places "
        f"{parts} there ({times} the mean model stage's time): placement, not the schedule; "
        "decoder_first/last_pipeline_num_layers can move layers off that rank"
    )


def summary_lines(summary: StepSummary) -> list[str]:
    """The end-of-run summary of the measured step."""
    lines = [
        f" measured step: iteration {summary.iteration}, {summary.schedule}, "
        f"PP={len(summary.busy_ms)}, {summary.microbatches} micro-batches, "
        f"makespan {summary.makespan_ms:.1f} ms (data-parallel rank 0)"
    ]
    for rank, (busy, bubble, simulated) in enumerate(
        zip(summary.busy_ms, summary.bubble, summary.simulated_bubble, strict=True)
    ):
        lines.append(
            f"   pipeline rank {rank}: busy {busy:.1f} ms, bubble {bubble:.1%} "
            f"(simulated {simulated:.1%})"
        )
    lines.append("   (simulated: each model stage with its own measured mean times)")
    if summary.placement_note is not None:
        lines.append(f"   {summary.placement_note}")
    if summary.bound_ms and summary.simulated_ms is not None:
        bound = summary.bound_ms
        lines.append(
            f" compute bound {bound:.1f} ms (the measured F, B and W compute shared evenly "
            f"over the ranks): the measured step is {summary.makespan_ms / bound:.3f}x it, the "
            f"simulated {summary.simulated_ms / bound:.3f}x"
        )
    if summary.png is not None:
        lines.append(f" timeline (measured above, simulated below): {summary.png}")
    return lines


def report_measured_step(
    measured: SimResult | None, iteration: int | None, png: str | Path
) -> list[str]:
    """Draw ``measured`` (the step of ``iteration``) above its prediction (:func:`predict`)
    into ``png`` (its folder made) and return the summary lines naming it
    (:func:`summary_lines`); where nothing was measured (None: the run ended before its
    second training step), the line that says so."""
    if measured is None or iteration is None:
        return [
            f" timeline: nothing drawn into {png}: the run ended before its second training "
            "step (the first warms up)"
        ]
    predicted = predict(measured)
    path = Path(png)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_side_by_side_png(measured, predicted, path)
    return summary_lines(StepSummary.of(iteration, measured, predicted, str(path)))
