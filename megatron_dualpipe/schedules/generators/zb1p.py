"""ZB-H1: 1F1B with every backward split into dX and a deferred dW (Qi et al., 2023)."""

from __future__ import annotations

from collections import deque

from ..ir import Action, Kind, Schedule
from .one_f_one_b import one_f_one_b


def zb1p(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B's forward and backward order, with dX sent upstream at once and rank r running
    each W ``r`` backwards late. The lag lets dX alone travel up the pipeline while the
    later ranks fill their cool-down with the W they held back; live activations stay at
    1F1B's ``ranks`` on every rank."""
    base = one_f_one_b(num_ranks, num_microbatches)
    ranks = []
    for rank, order in enumerate(base.ranks):
        actions: list[Action] = []
        deferred: deque[Action] = deque()
        for action in order:
            if action.kind is not Kind.BW:
                actions.append(action)
                continue
            actions.append(action._replace(kind=Kind.B))
            deferred.append(action._replace(kind=Kind.W))
            if len(deferred) > rank:
                actions.append(deferred.popleft())
        actions += deferred
        ranks.append(actions)
    bound = [min(num_ranks, num_microbatches)] * num_ranks
    return Schedule("zb1p", base.placement, ranks, bound)
