"""What ``train`` prints: Megatron-LM's iteration and validation log lines, a progress bar
on terminals, and the end-of-run summary of the measured step."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import TextIO

from ...schedules.simulate import SimResult

__all__ = [
    "IterationLog",
    "LogWindow",
    "ProgressBar",
    "StepSummary",
    "iteration_line",
    "summary_lines",
    "timestamp",
    "validation_lines",
]


@dataclass(frozen=True)
class IterationLog:
    """The figures of one iteration log line (averages over the logging interval)."""

    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float
    learning_rate: float
    global_batch_size: int
    lm_loss: float
    loss_scale: float
    grad_norm: float | None
    skipped: int
    nans: int
    #: Megatron-LM's "mtp_N loss" of each MTP layer (means over the interval).
    mtp_losses: tuple[float, ...] = ()
    #: TFLOP/s per GPU over the interval (``log_throughput``), else None.
    throughput: float | None = None


class LogWindow:
    """The iterations since the last log line: their losses, times, skips and NaNs."""

    def __init__(self) -> None:
        self._losses: list[float] = []
        self._seconds: list[float] = []
        self._skipped = 0
        self._nans = 0
        self._mtp: list[tuple[float, ...]] = []

    def add(
        self, loss: float, seconds: float, success: bool, mtp_losses: tuple[float, ...] = ()
    ) -> None:
        self._mtp.append(mtp_losses)
        self._losses.append(loss)
        self._seconds.append(seconds)
        self._skipped += not success
        self._nans += not math.isfinite(loss)

    def flush(
        self,
        *,
        iteration: int,
        train_iters: int,
        consumed_samples: int,
        learning_rate: float,
        global_batch_size: int,
        loss_scale: float,
        grad_norm: float | None,
    ) -> IterationLog:
        """The log line's figures (means over the window); starts a new window."""
        log = IterationLog(
            iteration=iteration,
            train_iters=train_iters,
            consumed_samples=consumed_samples,
            elapsed_ms=1e3 * math.fsum(self._seconds) / len(self._seconds),
            learning_rate=learning_rate,
            global_batch_size=global_batch_size,
            lm_loss=math.fsum(self._losses) / len(self._losses),
            loss_scale=loss_scale,
            grad_norm=grad_norm,
            skipped=self._skipped,
            nans=self._nans,
            mtp_losses=tuple(math.fsum(v) / len(v) for v in zip(*self._mtp, strict=True)),
        )
        self.__init__()
        return log


def timestamp() -> str:
    """Megatron-LM's log stamp of the current local time: ``[2026-11-30 16:45:22.123456]``."""
    return f"[{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"


def iteration_line(log: IterationLog) -> str:
    """Megatron-LM's training log line, after its time stamp; the loss with 7 significant
    digits."""
    parts = [
        f" {timestamp()} iteration {log.iteration:8d}/{log.train_iters:8d} |",
        f" consumed samples: {log.consumed_samples:12d} |",
        f" elapsed time per iteration (ms): {log.elapsed_ms:.1f} |",
        *(
            [f" throughput per GPU (TFLOP/s/GPU): {log.throughput:.1f} |"]
            if log.throughput is not None
            else []
        ),
        f" learning rate: {log.learning_rate:.6E} |",
        f" global batch size: {log.global_batch_size:5d} |",
        f" lm loss: {log.lm_loss:.6E} |",
        *(f" mtp_{i + 1} loss: {loss:.6E} |" for i, loss in enumerate(log.mtp_losses)),
        f" loss scale: {log.loss_scale:.1f} |",
    ]
    if log.grad_norm is not None:
        parts.append(f" grad norm: {log.grad_norm:.3f} |")
    parts.append(f" number of skipped iterations: {log.skipped:3d} |")
    parts.append(f" number of nan iterations: {log.nans:3d} |")
    return "".join(parts)


def validation_lines(iteration: int, lm_loss: float) -> list[str]:
    """Megatron-LM's validation block: the loss and its perplexity between rules."""
    ppl = math.exp(min(20.0, lm_loss)) if math.isfinite(lm_loss) else lm_loss
    text = (
        f" validation loss at iteration {iteration} | lm loss value: {lm_loss:.6E} |"
        f" lm loss PPL: {ppl:.6E} | "
    )
    rule = "-" * (len(text) + 1)
    return [rule, text, rule]


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
    if summary.png is not None:
        lines.append(f" timeline (measured above, simulated below): {summary.png}")
    return lines


class ProgressBar:
    """A one-line bar on ``stream`` when it is a terminal and ``CI`` is unset; else silent.
    Call :meth:`clear` before printing other lines."""

    WIDTH = 30

    def __init__(self, total: int, stream: TextIO | None = None):
        self.total = max(total, 1)
        self.stream = sys.stdout if stream is None else stream
        self.enabled = self.stream.isatty() and not os.environ.get("CI")

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        filled = self.WIDTH * done // self.total
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self.stream.write(f"\r [{bar}] {done}/{self.total} iterations")
        self.stream.flush()

    def clear(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
