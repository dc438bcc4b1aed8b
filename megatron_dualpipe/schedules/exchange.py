"""Where the lock-step plan exchanges each message: a round per message, one timeline.

A rank's *exchange points* are the boundaries around its computes: boundary ``a`` comes
right before its compute ``a`` (boundary ``n``, after the last of its ``n`` computes, ends
the step). The lock-step plan (:mod:`.comm_plan`) hands the backend one batch at each
exchange point and waits for it before the next compute, so nothing is pending while a
rank computes.

Each message gets a *round* ``t``: a time of one timeline of the schedule (every compute
run as soon as its inputs allow, F = B = W = 1, no latency; :func:`.simulate.simulate`)
between the end of its producer and the start of its consumer. Both ends exchange it at
their first boundary whose next compute starts at or after ``t``. That boundary comes after
the producer on the sender (a compute starts before it ends) and no later than the
consumer on the receiver (the consumer starts at or after ``t``), and it moves forward
with ``t`` on every rank. So every rank meets the rounds in one global order, and a plan
built this way finishes under NCCL's rules with every send waiting for its receive and
all of a rank's communicators on one stream: by induction over the rounds, once every
batch holding only earlier rounds has completed, every rank's batch holding round ``t``
is at the head of its stream (the computes before it needed only earlier rounds), so each
round-``t`` send meets its receive there. Several rounds at one boundary share its batch
(that batch stays at the head from its first round to its last).

Which ``t``: the earliest time from the producer's end at which both ranks sit between two
computes in that timeline, if there is one before the consumer starts (then neither waits
for the other there); otherwise the time that makes them wait least.
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
    """The round of a message made at ``produced`` and needed at ``consumed`` (see the
    module docstring)."""
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
