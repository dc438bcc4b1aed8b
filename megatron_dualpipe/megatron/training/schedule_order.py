"""The order a run's schedule executes in: a saved one (``schedule_file``) or one the
optimiser finds from the run's own measured step (``optimize_schedule``).

Either way the work is the generated schedule's, reordered, so losses stay those of the
generated schedule (and of 1F1B). The switch to an optimised order is collective: the
measured step is gathered on each pipeline's rank 0
(:class:`~..schedule.step_recorder.StepRecorder`), the P2P latency measured by ping-pong,
the optimiser runs on global rank 0, which broadcasts the schedule's text form; every rank
parses and validates it and hands it to the forward-backward object, whose executors are
rebuilt at the next step.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state

from ...runtime import p2p_latency_s
from ...schedules.ir import Schedule, ScheduleError
from ...schedules.saved import read_saved_schedule
from ...schedules.validate import validate
from ..schedule.forward_backward import DualPipeForwardBackward
from ..schedule.step_recorder import StepRecorder
from .errors import TrainError

__all__ = ["OPTIMIZE_SECONDS", "optimise_from_measured", "saved_schedule"]

#: Time limit of the optimiser in a training run (it usually ends far sooner).
OPTIMIZE_SECONDS = 10.0


def saved_schedule(path: str) -> Schedule:
    """The schedule in ``path`` (its text form), validated; the config has checked it
    already, so a failure here means the file changed since (one sentence)."""
    try:
        return read_saved_schedule(path)
    except (OSError, ScheduleError) as err:
        raise TrainError(f"schedule_file: {path} became unreadable or invalid: {err}") from None


def optimise_from_measured(
    forward_backward: DualPipeForwardBackward, recorder: StepRecorder, iteration: int
) -> str:
    """Optimise the order for the step ``recorder`` measured, switch every rank to it and
    return the line to log (global rank 0's; the same on every rank). Collective over the
    whole world. A failure of the optimiser keeps the running order and says why."""
    measured = recorder.gather()
    latency_ms = 1e3 * p2p_latency_s(parallel_state.get_pipeline_model_parallel_group())
    payload: list[object] = [None]
    if dist.get_rank() == 0:
        payload[0] = _optimise(measured, latency_ms, iteration)
    dist.broadcast_object_list(payload, src=0)
    text, line = payload[0]
    if text is None:
        return line
    try:
        schedule = Schedule.from_text(text)
        validate(schedule, dry_run=False)
    except ScheduleError as err:
        raise TrainError(
            f"iteration {iteration}: the optimised schedule rank 0 sent is invalid ({err}): "
            "set optimize_schedule: false and report this"
        ) from None
    forward_backward.use_schedule(schedule.compute_only())
    return line


def _optimise(measured, latency_ms: float, iteration: int) -> tuple[str | None, str]:
    """On global rank 0: the optimised schedule's text and the log line, or (None, why)."""
    from ...planner.optimize import Effort, measured_costs, optimize  # imports SciPy

    try:
        cost = measured_costs(measured, latency=latency_ms)
        result = optimize(
            measured.schedule.placement, cost, time_limit=OPTIMIZE_SECONDS, effort=Effort()
        )
    except ScheduleError as err:
        return None, (
            f" schedule not optimised at iteration {iteration}: {err}; "
            f"{measured.schedule.name} keeps its order"
        )
    hand = result.baseline_result.makespan
    line = (
        f" schedule optimised at iteration {iteration}: step {measured.makespan:.1f} ms -> "
        f"predicted {result.makespan:.1f} ms ({measured.schedule.name} predicted {hand:.1f} ms "
        f"for the measured costs, P2P latency {latency_ms:.3f} ms; lower bound "
        f"{result.lower_bound:.1f} ms, peak activations {result.peak_activations} per rank, "
        f"solved in {result.solve_seconds:.2f} s)"
    )
    if result.fell_back:
        line += f"; no order faster than {result.baseline.name} found: running it"
    return result.schedule.to_text(), line
