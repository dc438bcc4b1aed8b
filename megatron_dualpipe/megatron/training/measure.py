"""Measure one training step's timeline on every pipeline rank, under any schedule.

- Our schedules (zb1p, dualpipe, dualpipev): the runtime executor records the step itself
  (every F, B, W, BW and FB with its start and end), asked through
  :func:`..forward_backward.record_timelines`.
- Megatron's own schedules (1f1b, interleaved-1f1b): Megatron's ``forward_step`` and
  ``backward_step`` (looked up by name in ``megatron.core.pipeline_parallel.schedules``
  at each call) are timed while the recorder is active: each forward is an F and each
  backward a BW (dX and dW together) of the loop placement's stage; the ranks start
  after a barrier, as the executor does.

:meth:`StepRecorder.gather` collects the ranks' timelines on pipeline rank 0 as a
SimResult (times in ms; the runtime's ``gather_timeline``), so the simulator's exports
draw it, and the simulator's prediction for the same schedule with the measured mean
action durations can be put beside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as megatron_schedules

from ...runtime import RankTimeline, gather_timeline
from ...schedules.export import to_png
from ...schedules.generators import generate
from ...schedules.ir import Action, Kind, Schedule
from ...schedules.simulate import SimResult, simulate
from ..checks import OUR_SCHEDULES
from ..forward_backward import record_timelines

__all__ = ["StepRecorder", "predict", "write_side_by_side_png"]


class StepRecorder:
    """Context manager around one forward-backward call that records this rank's actions.

    ``model`` is this rank's list of model chunks (as passed to the forward-backward
    function). Collective over the pipeline group: every pipeline rank must record the
    same step.
    """

    def __init__(self, schedule: str, model: Sequence[Any], num_microbatches: int):
        self.schedule_name = schedule
        self.model = list(model)
        self.num_microbatches = num_microbatches
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.timeline: RankTimeline | None = None
        self.schedule: Schedule | None = None
        self._restore: list[tuple[Any, str, Any]] = []
        self._recording: Any = None

    def __enter__(self) -> StepRecorder:
        if self.schedule_name in OUR_SCHEDULES:
            self._recording = record_timelines(self._keep)
            self._recording.__enter__()
        else:
            chunks = len(self.model)
            options = {"chunks": chunks} if chunks > 1 else {}
            self.schedule = generate(
                self.schedule_name, self.pp_size, self.num_microbatches, **options
            )
            _MegatronStepTimer(self).install()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording = None
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()

    def patch(self, owner: Any, name: str, replacement: Any) -> None:
        """Set ``owner.name`` to ``replacement`` until the recorder exits."""
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _keep(self, timeline: RankTimeline, schedule: Schedule) -> None:
        self.timeline, self.schedule = timeline, schedule

    def gather(self) -> SimResult | None:
        """The measured step on pipeline rank 0 (None elsewhere); collective."""
        if self.timeline is None or self.schedule is None:
            raise RuntimeError("no step was recorded on this rank")
        return gather_timeline(self.timeline, self.schedule, group=self.group)


class _MegatronStepTimer:
    """Times Megatron's forward_step / backward_step for a :class:`StepRecorder`."""

    def __init__(self, recorder: StepRecorder):
        self.recorder = recorder
        self.chunk_of = {id(chunk): i for i, chunk in enumerate(recorder.model)}
        self.forwards = [0] * len(recorder.model)
        self.pending: dict[int, Action] = {}
        self.live = 0

    def install(self) -> None:
        recorder = self.recorder
        dist.barrier(group=recorder.group)
        recorder.timeline = RankTimeline(recorder.pp_rank)
        recorder.patch(
            megatron_schedules, "forward_step", self._forward(megatron_schedules.forward_step)
        )
        recorder.patch(
            megatron_schedules, "backward_step", self._backward(megatron_schedules.backward_step)
        )

    def _forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            timeline = self.recorder.timeline
            start = timeline.now()
            output, num_tokens = original(*args, **kwargs)
            chunk = self.chunk_of[id(args[2] if len(args) > 2 else kwargs["model"])]
            action = Action(
                Kind.F,
                chunk * self.recorder.pp_size + self.recorder.pp_rank,
                self.forwards[chunk],
                chunk,
            )
            self.forwards[chunk] += 1
            timeline.add(action, start, timeline.now())
            self.pending[id(output)] = action._replace(kind=Kind.BW)
            self.live += 1
            timeline.peak_activations = max(timeline.peak_activations, self.live)
            return output, num_tokens

        return forward_step

    def _backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def backward_step(*args: Any, **kwargs: Any) -> Any:
            timeline = self.recorder.timeline
            output = args[1] if len(args) > 1 else kwargs["output_tensor"]
            start = timeline.now()
            result = original(*args, **kwargs)
            timeline.add(self.pending.pop(id(output)), start, timeline.now())
            self.live -= 1
            return result

        return backward_step


def write_side_by_side_png(measured: SimResult, predicted: SimResult, path: Path) -> None:
    """One PNG: the measured step on top, the simulator's prediction below."""
    from matplotlib.image import imread, imsave

    parts = []
    for result, title in (
        (measured, f"{measured.schedule.name}: measured step (ms)"),
        (predicted, f"{predicted.schedule.name}: simulated with the measured mean durations"),
    ):
        part = path.with_name(f".{path.stem}.{len(parts)}.png")
        to_png(result, str(part), title=title)
        parts.append(imread(part))
        part.unlink()
    width = max(p.shape[1] for p in parts)
    padded = [
        np.pad(p, ((0, 0), (0, width - p.shape[1]), (0, 0)), constant_values=1.0) for p in parts
    ]
    imsave(path, np.concatenate(padded, axis=0))


def predict(measured: SimResult) -> SimResult:
    """The simulator's step for the measured schedule and its mean action durations."""
    return simulate(measured.schedule, measured.cost)
