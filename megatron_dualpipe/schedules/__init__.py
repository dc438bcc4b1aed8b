"""Layer 1, pure Python (no torch): the schedule IR, generators, lowering, validator,
simulator and exports. See docs/schedules.md."""

from .comm_plan import CommPlan, comm_plan
from .cost import CostModel
from .cuda_graphs import check_cuda_graph_order, cuda_graph_order
from .ir import Action, Kind, Placement, Schedule, ScheduleError
from .lowering import lower
from .nccl_rules import CommDeadlockError, check_nccl
from .registry import SCHEDULES, ScheduleSpec, generate, spec
from .simulate import DeadlockError, SimResult, simulate
from .validate import validate

__all__ = [
    "SCHEDULES",
    "Action",
    "CommDeadlockError",
    "CommPlan",
    "CostModel",
    "DeadlockError",
    "Kind",
    "Placement",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "SimResult",
    "check_cuda_graph_order",
    "check_nccl",
    "comm_plan",
    "cuda_graph_order",
    "generate",
    "lower",
    "simulate",
    "spec",
    "validate",
]
