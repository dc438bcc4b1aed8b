"""Fast timing of fixed per-rank orders, for the local search: the simulator's semantics
(an action starts when its rank is free and its inputs have arrived) on compact ops
instead of :class:`Action` objects, with each rank's peak live activations and the
critical path.

An op is ``(code, stage, index, stage2, index2)``: ``index`` counts the micro-batches of
``stage`` (``Instance.mbs``); codes are :data:`F`, :data:`B`, :data:`W`, :data:`BW`, and
:data:`FB` / :data:`FBW` (a forward ``stage, index`` paired with the backward
``stage2, index2``, its dX only or all of it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial

from ...schedules.ir import Action, Kind
from .deadline import Deadline
from .instance import Instance

__all__ = [
    "B",
    "BW",
    "F",
    "FB",
    "FBW",
    "W",
    "Timing",
    "channels",
    "from_actions",
    "halves",
    "time_orders",
    "to_actions",
]

F, B, W, BW, FB, FBW = range(6)
Op = tuple[int, int, int, int, int]
_KIND = {F: Kind.F, B: Kind.B, W: Kind.W, BW: Kind.BW}
_CODE = {Kind.F: F, Kind.B: B, Kind.W: W, Kind.BW: BW}
_new_action = partial(tuple.__new__, Action)


@dataclass
class Timing:
    """Start and end of every op, the makespan, per-rank peaks and end times, and for each
    op the op whose end fixed its start (None: it started at 0): ``(rank, position)``."""

    start: list[list[float]]
    end: list[list[float]]
    makespan: float
    peaks: list[int]
    finish: list[float]
    cause: list[list[tuple[int, int] | None]]

    def critical(self) -> list[tuple[int, int]]:
        """The ops on a longest path to the makespan, last first."""
        r = max(range(len(self.finish)), key=self.finish.__getitem__)
        at: tuple[int, int] | None = (r, len(self.end[r]) - 1)
        path = []
        while at is not None and at[1] >= 0:
            path.append(at)
            at = self.cause[at[0]][at[1]]
        return path


def halves(op: Op) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """The (stage, index) of an op's forward and of its backward (B or BW), or None."""
    code, s, k, s2, k2 = op
    forward = (s, k) if code == F or code >= FB else None
    if code in (B, BW):
        return forward, (s, k)
    return forward, ((s2, k2) if code >= FB else None)


def channels(inst: Instance, op: Op) -> set[tuple[str, tuple[int, int]]]:
    """The channels an op receives on or sends on (each must keep its message order)."""
    out = set()
    forward, backward = halves(op)
    if forward is not None:
        s = forward[0]
        if inst.next_remote[s]:
            out.add(("F", inst.f_channel[inst.next[s]]))
        if inst.prev_remote[s]:
            out.add(("F", inst.f_channel[s]))
    if backward is not None:
        s = backward[0]
        if inst.prev_remote[s]:
            out.add(("B", inst.b_channel[inst.prev[s]]))
        if inst.next_remote[s]:
            out.add(("B", inst.b_channel[s]))
    return out


def duration(inst: Instance, op: Op) -> float:
    code, s, _, s2, _ = op
    if code == F:
        return inst.f[s]
    if code == B:
        return inst.b[s]
    if code == W:
        return inst.w[s]
    if code == BW:
        return inst.b[s] + inst.w[s]
    return inst.pair[(s, s2, code == FBW)]


def time_orders(
    inst: Instance, orders: list[list[Op]], deadline: Deadline | None = None
) -> Timing | None:
    """Time ``orders``; None if they deadlock. Orders are assumed complete and locally
    consistent (the local search only makes moves that keep them so). Raises
    :class:`~.deadline.OutOfTime` once ``deadline`` passes."""
    check = deadline.check if deadline is not None else None
    n_ranks, lat = inst.num_ranks, inst.cost.latency
    fend: list[list[float | None]] = [[None] * len(m) for m in inst.mbs]
    bend: list[list[float | None]] = [[None] * len(m) for m in inst.mbs]
    fpos: list[list[tuple[int, int] | None]] = [[None] * len(m) for m in inst.mbs]
    bpos: list[list[tuple[int, int] | None]] = [[None] * len(m) for m in inst.mbs]
    prev, nxt = inst.prev, inst.next
    hop_in = [lat if x else 0.0 for x in inst.prev_remote]
    hop_back = [lat if x else 0.0 for x in inst.next_remote]
    f_dur, b_dur, w_dur, pair = inst.f, inst.b, inst.w, inst.pair
    starts = [[0.0] * len(o) for o in orders]
    ends = [[0.0] * len(o) for o in orders]
    cause: list[list[tuple[int, int] | None]] = [[None] * len(o) for o in orders]
    pc, clock, live, peak = [0] * n_ranks, [0.0] * n_ranks, [0] * n_ranks, [0] * n_ranks
    waiting: dict[tuple[int, int, int], int] = {}
    ready = deque(range(n_ranks))
    while ready:
        if check is not None:
            check()
        r = ready.popleft()
        order, i, now = orders[r], pc[r], clock[r]
        st, en, ca = starts[r], ends[r], cause[r]
        lv, pk = live[r], peak[r]
        n = len(order)
        while i < n:
            code, s, k, s2, k2 = order[i]
            at, why = now, ((r, i - 1) if i else None)
            if code == W:
                d = w_dur[s]
            else:
                if code == F or code >= FB:  # needs the previous stage's forward
                    q = prev[s]
                    if q is not None:
                        t = fend[q][k]
                        if t is None:
                            waiting[(F, q, k)] = r
                            break
                        t += hop_in[s]
                        if t > at:
                            at, why = t, fpos[q][k]
                if code != F:  # needs the gradient from the next stage (or its own F)
                    bs, bk = (s2, k2) if code >= FB else (s, k)
                    q = nxt[bs]
                    if q is None:
                        t = fend[bs][bk]
                        if t is None:
                            waiting[(F, bs, bk)] = r
                            break
                        if t > at:
                            at, why = t, fpos[bs][bk]
                    else:
                        t = bend[q][bk]
                        if t is None:
                            waiting[(B, q, bk)] = r
                            break
                        t += hop_back[bs]
                        if t > at:
                            at, why = t, bpos[q][bk]
                if code == F:
                    d = f_dur[s]
                elif code == B:
                    d = b_dur[s]
                elif code == BW:
                    d = b_dur[s] + w_dur[s]
                else:
                    d = pair[(s, s2, code == FBW)]
            if code == F or code >= FB:
                lv += 1
                if lv > pk:
                    pk = lv
            if code in (W, BW, FBW):
                lv -= 1
            now = at + d
            st[i], en[i], ca[i] = at, now, why
            if code == F or code >= FB:
                fend[s][k], fpos[s][k] = now, (r, i)
                waiter = waiting.pop((F, s, k), None)
                if waiter is not None:
                    ready.append(waiter)
            if code in (B, BW) or code >= FB:
                bs, bk = (s2, k2) if code >= FB else (s, k)
                bend[bs][bk], bpos[bs][bk] = now, (r, i)
                waiter = waiting.pop((B, bs, bk), None)
                if waiter is not None:
                    ready.append(waiter)
            i += 1
        pc[r], clock[r], live[r], peak[r] = i, now, lv, pk
    if any(pc[r] < len(orders[r]) for r in range(n_ranks)):
        return None
    finish = [e[-1] if e else 0.0 for e in ends]
    return Timing(starts, ends, max(finish, default=0.0), peak, finish, cause)


def to_actions(inst: Instance, orders: list[list[Op]]) -> list[list[Action]]:
    """The per-rank :class:`Action` lists of ``orders``."""

    def plain(code: int, s: int, k: int) -> Action:
        return _new_action((_KIND[code], s, inst.mbs[s][k], inst.chunk[s], ()))

    out = []
    for order in orders:
        acts = []
        for code, s, k, s2, k2 in order:
            if code >= FB:
                back = plain(BW if code == FBW else B, s2, k2)
                acts.append(Action.overlapped(plain(F, s, k), back))
            else:
                acts.append(plain(code, s, k))
        out.append(acts)
    return out


def from_actions(inst: Instance, ranks: list[list[Action]]) -> list[list[Op]]:
    """The ops of compute-only per-rank actions (the inverse of :func:`to_actions`)."""
    index = [{m: k for k, m in enumerate(mbs)} for mbs in inst.mbs]
    out = []
    for acts in ranks:
        order = []
        for a in acts:
            if a.kind is Kind.FB:
                f, b = a.sub
                code = FBW if b.kind is Kind.BW else FB
                order.append(
                    (
                        code,
                        f.stage,
                        index[f.stage][f.microbatch],
                        b.stage,
                        index[b.stage][b.microbatch],
                    )
                )
            else:
                order.append((_CODE[a.kind], a.stage, index[a.stage][a.microbatch], -1, -1))
        out.append(order)
    return out
