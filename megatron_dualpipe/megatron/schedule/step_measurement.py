"""One training step of a run measured on every pipeline rank, under Megatron-LM's loop.

:class:`StepMeasurement` is the timeline sink of a :class:`~.forward_backward.
DualPipeForwardBackward`: it lets the first training steps pass (the first warms up), then
gathers the next step's timeline on the pipeline's rank 0 (a collective over the pipeline
group, which every pipeline rank enters at the same step: they run the same steps), keeps
it as :attr:`measured` and stops the recording, so the rest of the run records nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron.core import parallel_state

from ...runtime import RankTimeline, gather_timeline
from ...schedules.ir import Schedule
from ...schedules.simulate import SimResult

__all__ = ["StepMeasurement"]


class StepMeasurement:
    """Measure the training step after ``skip`` of ``forward_backward``; ``iteration``
    tells the iteration a step belongs to (Megatron-LM's numbering) and ``group`` gives
    the pipeline's process group (default: Megatron's), both asked at the measured step."""

    def __init__(
        self,
        forward_backward: Any,
        *,
        iteration: Callable[[], int],
        group: Callable[[], Any] = parallel_state.get_pipeline_model_parallel_group,
        skip: int = 1,
    ):
        self.forward_backward = forward_backward
        self.iteration = iteration
        self.group = group
        self.skip = skip
        #: The measured step on the pipeline's rank 0 once measured (None elsewhere).
        self.measured: SimResult | None = None
        #: The iteration of the measured step, once measured.
        self.measured_iteration: int | None = None
        forward_backward.timeline_sink = self

    def __call__(self, timeline: RankTimeline, schedule: Schedule) -> None:
        if self.skip:
            self.skip -= 1
            return
        self.measured_iteration = self.iteration()
        self.measured = gather_timeline(timeline, schedule, group=self.group())
        self.forward_backward.timeline_sink = None
