"""Layer 1, pure Python (no torch): the schedule IR, generators, lowering, validator,
simulator and exports. See docs/schedules.md."""

from .cost import CostModel
from .generators import GENERATORS, generate, min_microbatches
from .ir import Action, Kind, Placement, Schedule, ScheduleError
from .lowering import lower
from .simulate import DeadlockError, SimResult, simulate
from .validate import validate

__all__ = [
    "GENERATORS",
    "Action",
    "CostModel",
    "DeadlockError",
    "Kind",
    "Placement",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "generate",
    "lower",
    "min_microbatches",
    "simulate",
    "validate",
]
