"""Schedule generators by name: each returns a compute-only :class:`Schedule`."""

from __future__ import annotations

from collections.abc import Callable

from ..ir import Schedule, ScheduleError
from .dualpipe import dualpipe, dualpipev
from .interleaved import interleaved_1f1b
from .one_f_one_b import one_f_one_b
from .zb1p import zb1p

__all__ = ["GENERATORS", "generate", "min_microbatches"]

GENERATORS: dict[str, Callable[..., Schedule]] = {
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb1p": zb1p,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
}


def generate(name: str, num_ranks: int, num_microbatches: int, **options: int) -> Schedule:
    """Build schedule ``name`` for ``num_ranks`` ranks and ``num_microbatches`` micro-batches."""
    if name not in GENERATORS:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {', '.join(GENERATORS)}")
    return GENERATORS[name](num_ranks, num_microbatches, **options)


def min_microbatches(name: str, num_ranks: int) -> int:
    """The fewest micro-batches schedule ``name`` accepts at ``num_ranks`` ranks."""
    minimum = {"dualpipe": 2 * num_ranks, "dualpipev": 2 * num_ranks, "interleaved-1f1b": num_ranks}
    return minimum.get(name, 1)
