"""Measure one training step's timeline on every pipeline rank, under any schedule.

Our schedules (zb1p, dualpipe, dualpipev) are recorded by the runtime executor, through
:meth:`~.forward_backward.DualPipeForwardBackward.recording`; Megatron's own (1f1b,
interleaved-1f1b) through a recording stand-in for ``config.timers``, each
``forward-compute`` an F and each ``backward-compute`` a BW in the rank's order of the
generated schedule (a step whose chunks do not follow it is refused).
:meth:`StepRecorder.gather` collects the timelines on pipeline rank 0 as a SimResult (ms),
which the simulator's exports draw. :class:`MeasuredForwardBackward` wraps a run's
forward-backward function for Megatron-LM's loop (``--pipeline-timeline``): the first
step warms up, the next is recorded and gathered, the rest run unrecorded. How and why:
docs/training.md, "The timeline: ``pipeline_timeline``".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from ...runtime import RankTimeline, gather_timeline
from ...runtime.timeline import clock_for, start_barrier
from ...schedules.ir import Action, Kind, Schedule
from ...schedules.registry import ScheduleSpec
from ...schedules.simulate import SimResult
from .forward_backward import DualPipeForwardBackward

__all__ = ["MeasuredForwardBackward", "StepRecorder"]


class StepRecorder:
    """Context manager around one forward-backward call that records this rank's actions.

    ``forward_backward`` is the function the step runs (ours or Megatron's), ``model``
    this rank's list of model chunks and ``config`` their TransformerConfig. Inside the
    block, run the step with :meth:`forward_step` in place of the forward-step function.
    Collective over the pipeline group: every pipeline rank must record the same step.
    """

    def __init__(
        self,
        schedule: ScheduleSpec,
        forward_backward: Callable[..., Any],
        model: Sequence[Any],
        config: Any,
        num_microbatches: int,
    ):
        self.spec = schedule
        self.forward_backward = forward_backward
        self.model = list(model)
        self.config = config
        self.num_microbatches = num_microbatches
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.timeline: RankTimeline | None = None
        self.schedule: Schedule | None = None
        self._exit: Callable[[], None] | None = None
        self._forward_chunks: list[int] = []
        #: Why this rank's step cannot be drawn (it ran other actions than generated).
        self.problem: str | None = None

    def __enter__(self) -> StepRecorder:
        if isinstance(self.forward_backward, DualPipeForwardBackward):
            recording = self.forward_backward.recording(self._keep)
            recording.__enter__()
            self._exit = functools.partial(recording.__exit__, None, None, None)
            return self
        chunks = len(self.model)
        options = {"chunks": chunks} if chunks > 1 else {}
        self.schedule = self.spec.generate(self.pp_size, self.num_microbatches, **options)
        start_barrier(self.group)
        device = next(self.model[0].parameters()).device
        self.timeline = RankTimeline(self.pp_rank, clock=clock_for(device))
        timers = _RecordingTimers(self, self.config.timers)
        previous, self.config.timers = self.config.timers, timers
        self._exit = functools.partial(setattr, self.config, "timers", previous)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._exit is not None:
            self._exit()
            self._exit = None

    def forward_step(self, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_step_func``, noting the chunk of every forward it runs under Megatron's
        schedules (ours record their own actions: unchanged)."""
        if isinstance(self.forward_backward, DualPipeForwardBackward):
            return forward_step_func
        chunk_of = {id(chunk): i for i, chunk in enumerate(self.model)}

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator: Iterator[Any], model: Any, *args: Any, **kwargs: Any):
            self._forward_chunks.append(chunk_of.get(id(model), 0))
            return forward_step_func(data_iterator, model, *args, **kwargs)

        return forward_step

    def _keep(self, timeline: RankTimeline, schedule: Schedule) -> None:
        self.timeline, self.schedule = timeline, schedule

    def gather(self) -> SimResult | None:
        """The measured step on pipeline rank 0 (None elsewhere); collective. Where any
        rank's step did not follow the generated order (:attr:`problem`), every rank raises
        that rank's sentence, after one all-gather (none waits for the others)."""
        if self.timeline is None or self.schedule is None:
            raise RuntimeError("no step was recorded on this rank")
        if self._forward_chunks and self.problem is None:
            self.problem = self._forward_order_problem()
        problems: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(problems, self.problem, group=self.group)
        found = [(rank, problem) for rank, problem in enumerate(problems) if problem]
        if found:
            rank, problem = found[0]
            raise RuntimeError(f"pipeline rank {rank}: {problem}")
        return gather_timeline(self.timeline, self.schedule, group=self.group)

    def _forward_order_problem(self) -> str | None:
        expected = [a.chunk for a in self.schedule.ranks[self.pp_rank] if a.kind is Kind.F]
        if self._forward_chunks == expected:
            return None
        return (
            f"{self.spec.name} ran its forwards on chunks {self._forward_chunks} but the "
            f"generated schedule orders them {expected}: the timeline cannot be drawn"
        )


class _RecordingTimers:
    """``config.timers`` for one step of Megatron's schedules: records each
    ``forward-compute`` / ``backward-compute`` interval as the rank's next F / BW of the
    generated schedule, and passes every call on to the timers it stands in for."""

    _KINDS = {"forward-compute": Kind.F, "backward-compute": Kind.BW}

    def __init__(self, recorder: StepRecorder, inner: Any):
        self.recorder = recorder
        self.inner = inner
        rank_actions = recorder.schedule.ranks[recorder.pp_rank]
        self._next = {
            kind: iter([a for a in rank_actions if a.kind is kind]) for kind in (Kind.F, Kind.BW)
        }
        self._started: dict[Kind, float] = {}
        self._live = 0

    def __call__(self, name: str, log_level: int | None = None) -> _RecordingTimer:
        inner = None
        if self.inner is not None:
            inner = self.inner(name) if log_level is None else self.inner(name, log_level=log_level)
        return _RecordingTimer(self, self._KINDS.get(name), inner)

    def start(self, kind: Kind) -> None:
        self._started[kind] = self.recorder.timeline.now()

    def stop(self, kind: Kind) -> None:
        timeline = self.recorder.timeline
        action: Action | None = next(self._next[kind], None)
        if action is None:  # said by gather() on every rank, not raised inside the step
            self.recorder.problem = (
                f"{self.recorder.spec.name} ran more {kind.value} actions than the "
                "generated schedule has: the timeline cannot be drawn"
            )
            self._started.pop(kind, None)
            return
        timeline.add(action, self._started.pop(kind), timeline.now())
        self._live += 1 if kind is Kind.F else -1
        timeline.peak_activations = max(timeline.peak_activations, self._live)


class _RecordingTimer:
    """One named timer handed out by :class:`_RecordingTimers`."""

    def __init__(self, timers: _RecordingTimers, kind: Kind | None, inner: Any):
        self.timers, self.kind, self.inner = timers, kind, inner

    def start(self, barrier: bool = False) -> None:
        if self.inner is not None:
            self.inner.start(barrier=barrier)
        if self.kind is not None:
            self.timers.start(self.kind)

    def stop(self, barrier: bool = False) -> None:
        if self.kind is not None:
            self.timers.stop(self.kind)
        if self.inner is not None:
            self.inner.stop(barrier=barrier)


class MeasuredForwardBackward:
    """``forward_backward`` (ours or Megatron's, for ``schedule``), measuring its training
    call after the first ``skip`` with a :class:`StepRecorder` (a collective over the
    pipeline group at the same call on every pipeline rank: they run the same steps):
    :attr:`measured` holds the step on the pipeline's rank 0 (None elsewhere) and
    :attr:`measured_iteration` the iteration ``iteration()`` names at that call. Forward-only
    calls (evaluation) pass through; any other attribute is the wrapped function's."""

    def __init__(
        self,
        forward_backward: Callable[..., Any],
        schedule: ScheduleSpec,
        *,
        iteration: Callable[[], int],
        skip: int = 1,
    ):
        self.inner = forward_backward
        self.schedule = schedule
        self.iteration = iteration
        self.skip = skip
        self.measured: SimResult | None = None
        self.measured_iteration: int | None = None

    def __call__(self, **kwargs: Any) -> Any:
        if kwargs.get("forward_only") or self.measured_iteration is not None:
            return self.inner(**kwargs)
        if self.skip:
            self.skip -= 1
            return self.inner(**kwargs)
        model = kwargs["model"]
        chunks = list(model) if isinstance(model, list | tuple) else [model]
        recorder = StepRecorder(
            self.schedule,
            self.inner,
            chunks,
            get_model_config(chunks[0]),
            kwargs["num_microbatches"],
        )
        with recorder:
            kwargs["forward_step_func"] = recorder.forward_step(kwargs["forward_step_func"])
            result = self.inner(**kwargs)
        self.measured_iteration = self.iteration()
        self.measured = recorder.gather()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
