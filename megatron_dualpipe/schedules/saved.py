"""A schedule saved by ``simulate --save`` (an optimised order, or a hand-edited one), read
back for a training run: checked against the run before any work, then run.

The file holds a schedule's text form (:meth:`~.ir.Schedule.to_text`). It is usable for a
run when it parses, validates with the dry run (a deadlock is found here, as ``simulate
--load`` finds it), keeps each stage's weight gradients in the order of its backwards,
and has the placement the run's schedule generates for its pipeline size and micro-batch
count. The work is the generated schedule's, reordered: losses stay the schedule's.
"""

from __future__ import annotations

from pathlib import Path

from .ir import Schedule, ScheduleError
from .registry import ScheduleSpec
from .validate import check_weight_grads_in_b_order, validate

__all__ = ["read_saved_schedule", "saved_schedule_problem"]


def saved_schedule_problem(
    path: str, found: ScheduleSpec, pp: int, microbatches: int
) -> str | None:
    """What makes the schedule file ``path`` unusable for a run of ``schedule`` on ``pp``
    ranks with ``microbatches`` micro-batches (unreadable, not a valid schedule, another
    placement), as a clause saying what to do; None where it is usable."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        return f"cannot read {path}: {err.strerror}"
    except UnicodeDecodeError:
        return f"{path} is not a schedule's text (not UTF-8): write it with simulate --save"
    try:
        saved = Schedule.from_text(text)
        validate(saved)
        check_weight_grads_in_b_order(saved)
    except ScheduleError as err:
        return f"{path} is not a valid schedule ({err}): write it with simulate --save"
    schedule = found.name
    expected = found.generate(pp, microbatches).placement
    p = saved.placement
    if p != expected:
        return (
            f"{path} holds a schedule of the {p.kind} placement for PP={p.num_ranks} with "
            f"{p.num_stages} stages and {p.num_microbatches} micro-batches, but this "
            f"{schedule} run has the {expected.kind} placement for PP={pp} with "
            f"{expected.num_stages} stages and {microbatches} micro-batches: save a schedule "
            f"for this run (simulate --schedule {schedule} --pp {pp} --microbatches "
            f"{microbatches} --optimize --save FILE)"
        )
    return None


def read_saved_schedule(path: str) -> Schedule:
    """The schedule in ``path``, validated, its compute actions only (what the executor
    takes); :class:`~.ir.ScheduleError` or ``OSError`` where it no longer reads."""
    saved = Schedule.from_text(Path(path).read_text(encoding="utf-8"))
    validate(saved, dry_run=False)
    return saved.compute_only()
