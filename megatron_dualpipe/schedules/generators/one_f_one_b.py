"""1F1B (PipeDream-flush), in Megatron-core's order."""

from __future__ import annotations

from ..ir import Placement, Schedule
from .program import RankProgram


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Each rank forwards ``ranks - rank - 1`` micro-batches ahead, then alternates one
    forward with one full backward, then drains the remaining backwards."""
    placement = Placement("loop", num_ranks, num_ranks, num_microbatches)
    ranks = []
    for rank in range(num_ranks):
        prog = RankProgram(placement, rank, [range(num_microbatches)])
        warmup = min(num_ranks - rank - 1, num_microbatches)
        for _ in range(warmup):
            prog.forward()
        for _ in range(num_microbatches - warmup):
            prog.forward()
            prog.backward()
        for _ in range(warmup):
            prog.backward()
        ranks.append(prog.actions)
    bound = [min(num_ranks - r, num_microbatches) for r in range(num_ranks)]
    return Schedule("1f1b", placement, ranks, bound)
