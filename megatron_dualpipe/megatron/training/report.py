"""What ``train`` prints: Megatron-LM's iteration and validation log lines, a progress bar
on terminals, and the end-of-run summary of the measured step."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import TextIO

__all__ = [
    "IterationLog",
    "LogWindow",
    "ProgressBar",
    "iteration_line",
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
