"""Layer 1, pure Python (no torch): the schedule IR, generators, lowering, validator,
simulator and exports. See docs/schedules.md."""

from .cost import CostModel
from .ir import Action, Kind, Placement, Schedule, ScheduleError
from .lowering import lower
from .registry import SCHEDULES, ScheduleSpec, generate, spec
from .simulate import DeadlockError, SimResult, simulate
from .validate import validate

__all__ = [
    "SCHEDULES",
    "Action",
    "CostModel",
    "DeadlockError",
    "Kind",
    "Placement",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "SimResult",
    "generate",
    "lower",
    "simulate",
    "spec",
    "validate",
]
