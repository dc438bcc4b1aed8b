"""Megatron-LM's ``--profile --use-pytorch-profiler`` in this trainer.

The steps after iteration ``profile_step_start`` up to iteration ``profile_step_end`` (the
``profile_step_end - profile_step_start`` steps Megatron-LM's profiler schedule keeps
active) run under ``torch.profiler`` on each rank of ``profile_ranks`` (unset: every rank,
as Megatron-LM's empty default), with the CUDA activity where the rank has a GPU. Under
our schedules each pipeline action runs in a ``record_function`` span
(:meth:`~..forward_backward.DualPipeForwardBackward.profiling`); Megatron's own schedules
add none. When the last profiled step ends, the rank writes its Chrome trace as
Megatron-LM names it, ``rank-N.json.gz``, into :attr:`TrainConfig.profile_dir`; the
trace reads back with ``megatron-dualpipe simulate --profile``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig

__all__ = ["StepProfiler"]


class StepProfiler:
    """Profiles one rank's steps as the config says; a no-op where it says not to."""

    def __init__(self, cfg: TrainConfig, rank: int, forward_backward: Any):
        ranks = cfg.profiled_ranks()
        self.enabled = cfg.profile and (ranks is None or rank in ranks)
        self.cfg, self.rank = cfg, rank
        self._forward_backward = forward_backward
        self._profiler: torch.profiler.profile | None = None
        self._spans = contextlib.ExitStack()
        #: The trace written, once written.
        self.path: Path | None = None

    def before_step(self, done: int) -> None:
        """Call before the step that follows ``done`` finished iterations."""
        if not self.enabled or self._profiler is not None or self.path is not None:
            return
        if self.cfg.profile_step_start <= done < self.cfg.profile_step_end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
            profiling = getattr(self._forward_backward, "profiling", None)
            if profiling is not None:  # Megatron's own schedules have no action spans
                self._spans.enter_context(profiling())

    def after_step(self, done: int) -> None:
        """Call after a step, ``done`` finished iterations counting it."""
        if self._profiler is not None and (done >= self.cfg.profile_step_end):
            self.close()

    def close(self) -> None:
        """Stop profiling (at the last profiled step, or when training stops before it)
        and write the trace."""
        if self._profiler is None:
            return
        self._spans.close()
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        folder = Path(self.cfg.profile_dir or ".")
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank-{self.rank}.json.gz"
        profiler.export_chrome_trace(str(self.path))
