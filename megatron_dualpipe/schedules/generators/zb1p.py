"""ZB-H1: 1F1B with every backward split into dX and a deferred dW (Qi et al., 2023)."""

from __future__ import annotations

from ..ir import Placement, Schedule, ScheduleError
from .program import RankProgram


def zb1p(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B's warm-up and steady order, with dX sent upstream at once and rank r running
    each W ``r`` backwards late. The lag lets dX alone travel up the pipeline while the
    later ranks fill their cool-down with the W they held back; live activations stay at
    1F1B's ``ranks`` on every rank."""
    if num_ranks < 1 or num_microbatches < 1:
        raise ScheduleError("zb1p needs at least one rank and one micro-batch")
    placement = Placement("loop", num_ranks, num_ranks, num_microbatches)
    ranks = []
    for rank in range(num_ranks):
        prog = RankProgram(placement, rank, [range(num_microbatches)])
        warmup = min(num_ranks - rank - 1, num_microbatches)
        for _ in range(warmup):
            prog.forward()
        for i in range(num_microbatches):
            if i + warmup < num_microbatches:
                prog.forward()
            prog.backward(split=True)
            if prog.deferred > rank:
                prog.weight()
        while prog.deferred:
            prog.weight()
        ranks.append(prog.actions)
    bound = [min(num_ranks, num_microbatches)] * num_ranks
    return Schedule("zb1p", placement, ranks, bound)
