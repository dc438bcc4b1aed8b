"""Selecting a pipeline schedule: ``install()`` and ``get_forward_backward_func``.

Where the run's schedule is recorded, in order of precedence:
1. the ``pipeline_schedule=`` argument of :func:`get_forward_backward_func`;
2. :func:`install` / :func:`set_pipeline_schedule` (process-wide, e.g. from
   ``--pipeline-schedule`` or the YAML config);
3. none: Megatron's own choice (1F1B, or interleaved with a virtual pipeline).
``1f1b`` and ``interleaved-1f1b`` always select Megatron's own functions.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from megatron.core.pipeline_parallel import schedules as megatron_schedules

from .checks import MEGATRON_SCHEDULES, OUR_SCHEDULES, DualPipeConfigError
from .forward_backward import make_forward_backward_func

__all__ = ["get_forward_backward_func", "install", "pipeline_schedule", "set_pipeline_schedule"]

_megatron_get_forward_backward_func = megatron_schedules.get_forward_backward_func
_schedule: str | None = None


def set_pipeline_schedule(name: str | None) -> None:
    """Record the run's schedule (None: let Megatron choose)."""
    global _schedule
    if name is not None and name not in (*OUR_SCHEDULES, *MEGATRON_SCHEDULES):
        known = ", ".join((*MEGATRON_SCHEDULES, *OUR_SCHEDULES))
        raise DualPipeConfigError(f"unknown pipeline schedule {name!r}: choose one of {known}")
    _schedule = name


def pipeline_schedule() -> str | None:
    """The schedule recorded by :func:`set_pipeline_schedule`."""
    return _schedule


def get_forward_backward_func(
    pp_size: int | None = None,
    vp_size: int | None = None,
    *,
    pipeline_schedule: str | None = None,
) -> Callable[..., Any]:
    """Megatron's ``get_forward_backward_func``, aware of our schedules."""
    name = pipeline_schedule or _schedule
    if name in OUR_SCHEDULES:
        return make_forward_backward_func(name)
    if name is not None and name not in MEGATRON_SCHEDULES:
        set_pipeline_schedule(name)  # raises the clear error
    return _megatron_get_forward_backward_func(pp_size, vp_size)


def install(pipeline_schedule: str | None = None) -> None:
    """Make every ``get_forward_backward_func`` that megatron modules imported return ours
    for our schedules; idempotent. Optionally records the run's schedule."""
    if pipeline_schedule is not None:
        set_pipeline_schedule(pipeline_schedule)
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if not name.startswith("megatron") or name.startswith("megatron_dualpipe"):
            continue
        if (
            getattr(module, "get_forward_backward_func", None)
            is _megatron_get_forward_backward_func
        ):
            module.get_forward_backward_func = get_forward_backward_func
