"""The schedule optimiser: a placement's work in a new per-rank order for a given cost
model and memory cap, with a proven lower bound. Pure Python plus SciPy (HiGHS); not
imported by :mod:`megatron_dualpipe.schedules`. See docs/optimizer.md."""

from .bound import Bound, lower_bound
from .instance import Instance
from .measured import measured_costs
from .optimizer import Effort, OptimizeResult, hand_schedules, optimize, optimize_on_placements
from .report import bubble_removed, summary, summary_json

__all__ = [
    "Bound",
    "Effort",
    "Instance",
    "OptimizeResult",
    "bubble_removed",
    "hand_schedules",
    "lower_bound",
    "measured_costs",
    "optimize",
    "optimize_on_placements",
    "summary",
    "summary_json",
]
