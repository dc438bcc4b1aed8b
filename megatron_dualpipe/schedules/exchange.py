"""Where the lock-step plan exchanges each message: a round per message, one timeline.

A rank's *exchange points* are the boundaries around its computes (boundary ``a`` right
before its compute ``a``, boundary ``n`` after the last); the lock-step plan
(:mod:`.comm_plan`) hands the backend one batch at each and waits for it before the next
compute. Each message gets a *round* ``t`` in one timeline of the schedule
(:func:`.simulate.simulate`, F = B = W = 1, no latency) between its producer's end and its
consumer's start, and both ends exchange it at their first boundary whose next compute
starts at or after ``t``; such a plan finishes under NCCL's rules with every send waiting
for its receive and a rank's communicators on one stream. The choice of ``t`` and the
proof: docs/runtime.md, "Communication on NCCL".
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from typing import NamedTuple

from .cost import CostModel
from .ir import Action, Kind, Placement, Schedule
from .lowering import MessageKey, message_key, peer_of
from .simulate import simulate

__all__ = ["Exchange", "exchange_points"]


class Exchange(NamedTuple):
    """One end of one message at an exchange point: its round, the message, whether this
    rank sends or receives it and the peer."""

    round: float
    key: MessageKey
    kind: str  # "send" or "recv"
    peer: int

    def order(self) -> tuple:
        """The order of a batch's operations, the same on both ends of every message."""
        kind, stage, mb = self.key
        return (self.round, kind is Kind.RECV_B, stage, mb)


class _Gaps:
    """One rank's timeline: boundary ``a`` lies between the end of compute ``a - 1`` and
    the start of compute ``a``."""

    def __init__(self, starts: list[float], ends: list[float]):
        self.starts = starts
        self.opens = [0.0, *ends]  # when each boundary is reached
        self.closes = [*starts, math.inf]  # when the compute after it starts

    def boundary(self, t: float) -> int:
        """The first boundary whose next compute starts at or after ``t``."""
        return bisect_left(self.starts, t)


def _round(sender: _Gaps, receiver: _Gaps, produced: float, consumed: float) -> float:
    """The round of a message made at ``produced`` and needed at ``consumed`` (see
    docs/runtime.md, "Communication on NCCL")."""
    best, least = produced, math.inf
    t = produced
    while t <= consumed:
        a, b = sender.boundary(t), receiver.boundary(t)
        meet = max(sender.opens[a], receiver.opens[b])
        wait = max(0.0, meet - sender.closes[a]) + max(0.0, meet - receiver.closes[b])
        if meet <= t:
            return t  # both between computes at t: nobody waits
        if wait < least:
            best, least = t, wait
        t = meet
    return best


def _routes(half: Action, placement: Placement) -> list[tuple[str, Kind, int, int]]:
    """What a compute half of this kind on this stage sends and receives, as
    :func:`.lowering.lower` has it: (``"send"`` or ``"recv"``, the message key's kind and
    stage, the peer), the same for every micro-batch."""
    if half.kind is Kind.W:
        return []
    prev_remote, next_remote = placement.remote_neighbours(half.stage)
    forward = half.kind is Kind.F
    comms = [
        (Kind.RECV_F if forward else Kind.RECV_B, prev_remote if forward else next_remote),
        (Kind.SEND_F if forward else Kind.SEND_B, next_remote if forward else prev_remote),
    ]
    found = []
    for kind, remote in comms:
        if remote:
            comm = Action(kind, half.stage, 0, half.chunk)
            way = "recv" if kind in (Kind.RECV_F, Kind.RECV_B) else "send"
            key_kind, key_stage, _ = message_key(comm, placement)
            found.append((way, key_kind, key_stage, peer_of(comm, placement)))
    return found


def exchange_points(
    schedule: Schedule, computes: Sequence[Sequence[Action]]
) -> list[list[list[Exchange]]]:
    """Per rank, per boundary of its ``computes`` (the compute actions it runs, in order:
    ``len + 1`` boundaries), the exchanges there in batch order."""
    p = schedule.placement
    timed = simulate(Schedule(schedule.name, p, [list(c) for c in computes]), CostModel())
    gaps = []
    for stats in timed.ranks:
        gaps.append(_Gaps([a.start for a in stats.actions], [a.end for a in stats.actions]))
    made: dict[MessageKey, tuple[int, float]] = {}
    needed: dict[MessageKey, tuple[int, float]] = {}
    routes: dict[tuple[Kind, int], list[tuple[str, Kind, int, int]]] = {}
    for rank, actions in enumerate(computes):
        for action, timing in zip(actions, timed.ranks[rank].actions, strict=True):
            for half in action.computes:
                found = routes.get((half.kind, half.stage))
                if found is None:
                    found = routes[(half.kind, half.stage)] = _routes(half, p)
                for way, kind, stage, _ in found:
                    key = (kind, stage, half.microbatch)
                    if way == "send":
                        made[key] = (rank, timing.end)
                    else:
                        needed[key] = (rank, timing.start)
    points: list[list[list[Exchange]]] = [[[] for _ in range(len(a) + 1)] for a in computes]
    for key, (sender, produced) in made.items():
        receiver, consumed = needed[key]
        t = _round(gaps[sender], gaps[receiver], produced, consumed)
        points[sender][gaps[sender].boundary(t)].append(Exchange(t, key, "send", receiver))
        points[receiver][gaps[receiver].boundary(t)].append(Exchange(t, key, "recv", sender))
    for boundaries in points:
        for exchanges in boundaries:
            exchanges.sort(key=Exchange.order)
    return points
