"""TensorBoard scalars of a training run, under Megatron-LM's names, on the logging rank.

With ``tensorboard_dir`` set, global rank 0 (the rank that prints the log) writes what
Megatron-LM's ``training_log`` writes, under its tags and on its intervals: every
``tensorboard_log_interval`` iterations (Megatron-LM's key, default 1) that iteration's
``lm loss``, ``learning-rate``, ``batch-size``, ``loss-scale``, ``grad-norm`` (each also
``... vs samples``, against consumed samples) and ``mtp_N loss``; at every iteration that
prints a log line (``log_interval``) the timings: ``iteration-time`` (seconds per
iteration over the interval, the log line's) and ours, from the step measured there,
``pipeline-bubble/rank-R`` (the measured bubble ratio of pipeline rank R of data-parallel
replica 0) and, under schedules with FB pairs, ``overlapped-fb-pairs`` (per step, over that
replica's pipeline); after each evaluation ``lm loss validation`` and ``lm loss validation
ppl`` (and their ``vs samples``).

The events go through ``torch.utils.tensorboard.SummaryWriter``, which needs the
``tensorboard`` package: an optional dependency, refused in one sentence before any work
when it is missing (:func:`check_tensorboard`).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...writable import unwritable
from .config import ConfigError, TrainConfig, blame

__all__ = [
    "MEMORY_SCALARS",
    "TENSORBOARD_INSTALL",
    "StepScalars",
    "TensorBoardLog",
    "check_tensorboard",
]

#: Megatron-LM's ``--log-memory-to-tensorboard`` tags and the ``torch.cuda.memory_stats()``
#: entry each writes.
MEMORY_SCALARS = {
    "mem-reserved-bytes": "reserved_bytes.all.current",
    "mem-allocated-bytes": "allocated_bytes.all.current",
    "mem-max-allocated-bytes": "allocated_bytes.all.peak",
    "mem-allocated-count": "allocation.all.current",
}
#: What to install for ``tensorboard_dir`` (setup.py's ``[tensorboard]`` extra).
TENSORBOARD_INSTALL = "pip install 'tensorboard>=2.14'"


def check_tensorboard(cfg: TrainConfig, source: str) -> None:
    """Refuse, in one sentence, ``tensorboard_dir`` without the tensorboard package or
    where this process cannot write (the run's folder in it made here if missing)."""
    if cfg.tensorboard_dir is None:
        return
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            f"{blame(source, 'tensorboard_dir')}: tensorboard_dir: "
            "writing TensorBoard events needs the tensorboard "
            f"package, which is not installed: {TENSORBOARD_INSTALL} (or unset tensorboard_dir)"
        )
    why = unwritable(cfg.tensorboard_run_dir)
    if why is not None:
        raise ConfigError(
            f"{blame(source, 'tensorboard_dir')}: tensorboard_dir: "
            f"cannot write to {cfg.tensorboard_run_dir} ({why}): "
            "set tensorboard_dir to a folder this user can write to, or unset it"
        )


@dataclass(frozen=True)
class StepScalars:
    """One iteration's figures, written every ``tensorboard_log_interval``."""

    iteration: int
    consumed_samples: int
    lm_loss: float
    learning_rate: float
    global_batch_size: int
    loss_scale: float
    grad_norm: float | None
    #: Megatron-LM's "mtp_N loss" of each MTP layer.
    mtp_losses: tuple[float, ...] = ()


class TensorBoardLog:
    """The run's event file in ``directory``; call :meth:`close` at the end."""

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=directory)

    def _both(self, tag: str, value: float, iteration: int, samples: int) -> None:
        self.writer.add_scalar(tag, value, iteration)
        self.writer.add_scalar(f"{tag} vs samples", value, samples)

    def step(self, step: StepScalars) -> None:
        """The figures of one iteration."""
        i, samples = step.iteration, step.consumed_samples
        self._both("learning-rate", step.learning_rate, i, samples)
        self._both("batch-size", step.global_batch_size, i, samples)
        self._both("lm loss", step.lm_loss, i, samples)
        for k, loss in enumerate(step.mtp_losses):
            self._both(f"mtp_{k + 1} loss", loss, i, samples)
        self._both("loss-scale", step.loss_scale, i, samples)
        if step.grad_norm is not None:
            self._both("grad-norm", step.grad_norm, i, samples)

    def iteration_time(self, iteration: int, seconds: float) -> None:
        """The log line's mean seconds per iteration."""
        self.writer.add_scalar("iteration-time", seconds, iteration)

    def throughput(self, iteration: int, tflops_per_gpu: float) -> None:
        """The log line's TFLOP/s per GPU (``log_throughput``), Megatron-LM's ``throughput``."""
        self.writer.add_scalar("throughput", tflops_per_gpu, iteration)

    def memory(self, iteration: int, stats: Mapping[str, int]) -> None:
        """Megatron-LM's memory scalars from ``torch.cuda.memory_stats()``'s ``stats``
        (``log_memory_to_tensorboard``)."""
        for tag, key in MEMORY_SCALARS.items():
            self.writer.add_scalar(tag, stats[key], iteration)

    def validation(self, iteration: int, samples: int, lm_loss: float) -> None:
        """One evaluation's loss and perplexity, as Megatron-LM's evaluation writes them."""
        self._both("lm loss validation", lm_loss, iteration, samples)
        ppl = math.exp(min(20.0, lm_loss)) if math.isfinite(lm_loss) else lm_loss
        self._both("lm loss validation ppl", ppl, iteration, samples)

    def measured(self, iteration: int, bubbles: Sequence[float], overlapped: int | None) -> None:
        """The measured step's bubble ratio per pipeline rank and its overlapped FB pairs."""
        for rank, bubble in enumerate(bubbles):
            self.writer.add_scalar(f"pipeline-bubble/rank-{rank}", bubble, iteration)
        if overlapped is not None:
            self.writer.add_scalar("overlapped-fb-pairs", overlapped, iteration)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def open_log(cfg: TrainConfig, rank: int) -> Any:
    """The run's :class:`TensorBoardLog` (in ``cfg.tensorboard_run_dir``) on global rank 0
    when ``tensorboard_dir`` is set, else None."""
    if cfg.tensorboard_run_dir is None or rank != 0:
        return None
    return TensorBoardLog(cfg.tensorboard_run_dir)
