"""Local search on per-rank orders around the critical path.

A move changes one rank's order where a longest path to the makespan passes from one op
to the next on that rank: swap the two (the job-shop "critical block" neighbourhood),
issue a forward and a backward as one FB pair where that is shorter, split a pair, or
move a W later. Every move keeps the order valid: no op before one it depends on, each
stage's forwards, backwards and W in micro-batch order, each shared channel's messages
in their order; the memory cap is checked by timing. A move is kept if it lowers the
makespan, or keeps it and lowers the sum of the ranks' end times.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from .deadline import Deadline, OutOfTime
from .instance import Instance
from .timing import BW, FB, FBW, B, F, Op, Timing, W, channels, halves, time_orders

__all__ = ["improve", "pair_adjacent"]

Orders = list[list[Op]]


class _Rules:
    """What may swap with what on one instance."""

    def __init__(self, inst: Instance):
        self.inst = inst

    def may_swap(self, a: Op, b: Op) -> bool:
        """Whether ``b`` may run before ``a`` (they are adjacent, ``a`` first)."""
        inst = self.inst
        af, ab = halves(a)
        bf, bb = halves(b)
        if a[0] == W and b[0] == W:
            return a[1] != b[1]
        if b[0] == W:
            return ab is None or ab != (b[1], b[2])
        if a[0] == W:
            return True  # a W depends on nothing later
        # the same stage (micro-batch order), or the next stage of the same micro-batch
        if af and bf and (af[0] == bf[0] or (inst.next[af[0]] == bf[0] and af[1] == bf[1])):
            return False
        if ab and bb and (ab[0] == bb[0] or (inst.prev[ab[0]] == bb[0] and ab[1] == bb[1])):
            return False
        if af is not None and af == bb:
            return False
        return not (inst.shared_channels and channels(inst, a) & channels(inst, b))


def _excess(orders: Orders, caps: tuple[int, ...]) -> int:
    """Over all ranks and allocations, the activations held beyond the cap."""
    total = 0
    for order, cap in zip(orders, caps, strict=True):
        live = 0
        for op in order:
            code = op[0]
            if code == F or code >= FB:
                live += 1
                if live > cap:
                    total += live - cap
            if code in (W, BW, FBW):
                live -= 1
    return total


def _objective(t: Timing, orders: Orders, caps: tuple[int, ...]) -> tuple[int, float, float]:
    """Activations over the caps first (zero once repaired), then makespan, then the sum
    of the ranks' end times."""
    over = _excess(orders, caps) if any(p > c for p, c in zip(t.peaks, caps, strict=True)) else 0
    return (over, round(t.makespan, 9), round(sum(t.finish), 9))


def _over_cap_moves(inst: Instance, orders: Orders, rules: _Rules):
    """On each rank above its cap, at the first op that allocates beyond it: run it one
    step later, split it if it is a pair, or bring the next W forward to just before it."""
    for r, order in enumerate(orders):
        live = 0
        for i, op in enumerate(order):
            fwd, _ = halves(op)
            if fwd is not None and live + 1 > inst.caps[r]:
                if i + 1 < len(order) and rules.may_swap(op, order[i + 1]):
                    yield r, order[:i] + [order[i + 1], op] + order[i + 2 :]
                if op[0] >= FB:
                    for split in _splits(op)[1:]:
                        yield r, order[:i] + split + order[i + 1 :]
                for j in range(i + 1, len(order)):
                    w = order[j]
                    if w[0] == W:
                        done = order[:i]
                        has_b = any(halves(x)[1] == (w[1], w[2]) for x in done)
                        same_stage_w = any(x[0] == W and x[1] == w[1] for x in order[i:j])
                        if has_b and not same_stage_w:
                            yield r, order[:i] + [w] + order[i:j] + order[j + 1 :]
                        break
                break
            if fwd is not None:
                live += 1
            if op[0] in (W, BW, FBW):
                live -= 1


def _moves(inst: Instance, orders: Orders, timing: Timing, rules: _Rules):
    """Candidate new orders around the critical path, each with its kind's rank (tried
    first to last): 0 a W back to right after its B, 1 a swap, 2 a W later, 3 a pair
    formed or split."""
    path = timing.critical()
    arcs = [(r, i) for (r, i) in path if i > 0 and timing.cause[r][i] == (r, i - 1)]
    for r, i in arcs:
        order = orders[r]
        a, b = order[i - 1], order[i]
        if rules.may_swap(a, b):
            yield 1, r, order[: i - 1] + [b, a] + order[i + 1 :]
        for with_w in (False, True):  # pair a forward with a backward's dX, or all of it
            pair = _pair(inst, a, b, with_w)
            if pair is None:
                continue
            new = order[: i - 1] + [pair] + order[i + 1 :]
            if pair[0] == FBW and a[0] != BW and b[0] != BW:
                new.remove((W, pair[3], pair[4], -1, -1))
            yield 3, r, new
        for j, op in ((i - 1, a), (i, b)):
            if op[0] >= FB:
                for split in _splits(op):
                    yield 3, r, order[:j] + split + order[j + 1 :]
            if op[0] == W:
                back = next(
                    (x for x in range(j - 1, -1, -1) if halves(order[x])[1] == (op[1], op[2])),
                    None,
                )
                between = order[back + 1 : j] if back is not None else []
                if back is not None and not any(x[0] == W and x[1] == op[1] for x in between):
                    yield 0, r, order[: back + 1] + [op] + between + order[j + 1 :]
                for to in (j + 2, j + 4, len(order)):
                    passed = order[j + 1 : to]
                    if to <= len(order) and not any(x[0] == W and x[1] == op[1] for x in passed):
                        yield 2, r, order[:j] + passed + [op] + order[to:]


def _pair(inst: Instance, a: Op, b: Op, bw: bool) -> Op | None:
    if a[0] == F and b[0] in (B, BW):
        f, back = a, b
    elif b[0] == F and a[0] in (B, BW):
        f, back = b, a
    else:
        return None
    if (f[1], f[2]) == (back[1], back[2]):
        return None
    use_bw = bw or back[0] == BW
    if not inst.pair_pays(f[1], back[1], use_bw):
        return None
    return (FBW if use_bw else FB, f[1], f[2], back[1], back[2])


def pair_adjacent(inst: Instance, orders: Orders) -> Orders:
    """``orders`` with every forward directly followed by a backward of another
    micro-batch issued together with it where the pair is shorter: what Megatron's
    interleaved 1F1B does in its steady state with its all-to-all overlap."""
    out = []
    for order in orders:
        paired: list[Op] = []
        for op in order:
            last = paired[-1] if paired else None
            forward_then_back = last is not None and last[0] == F and op[0] in (B, BW)
            pair = _pair(inst, last, op, op[0] == BW) if forward_then_back else None
            if pair is not None:
                paired[-1] = pair
            else:
                paired.append(op)
        out.append(paired)
    return out


def _splits(op: Op) -> list[list[Op]]:
    code, s, k, s2, k2 = op
    f = (F, s, k, -1, -1)
    b = (B, s2, k2, -1, -1)
    if code == FB:
        return [[f, b], [b, f]]
    w = (W, s2, k2, -1, -1)
    return [[f, b, w], [b, f, w], [b, w, f]]


def improve(
    inst: Instance,
    orders: Orders,
    deadline: float,
    *,
    evaluations: int | None = None,
    seed: int = 0,
    on_better: Callable[[float], None] | None = None,
    timing: Timing | None = None,
) -> tuple[Orders, Timing]:
    """First-improvement descent from ``orders`` (whose ``timing`` may be given) until no
    move helps, ``deadline`` (a ``time.perf_counter`` value) passes, also in the middle of a
    timing, or ``evaluations`` timings have been spent; returns the best orders and their
    timing. Orders above the memory caps are first repaired (the result may still be above
    them if the deadline comes first or no repair move helps: callers check)."""
    rules = _Rules(inst)
    rng = random.Random(seed)
    best = timing if timing is not None else time_orders(inst, orders)
    if best is None:
        raise ValueError("the starting orders deadlock")
    caps = inst.caps
    score = _objective(best, orders, caps)
    improved, spent = True, 0
    clock = Deadline(deadline)

    def out_of_budget() -> bool:
        return time.perf_counter() >= deadline or (evaluations is not None and spent >= evaluations)

    while improved and not out_of_budget():
        improved = False
        if score[0]:
            moves = [(0, r, new) for r, new in _over_cap_moves(inst, orders, rules)]
        else:
            moves = list(_moves(inst, orders, best, rules))
        rng.shuffle(moves)
        moves.sort(key=lambda move: move[0])
        for _, r, new in moves:
            if out_of_budget():
                break
            trial = orders[:r] + [new] + orders[r + 1 :]
            try:
                timing = time_orders(inst, trial, clock)
            except OutOfTime:
                break
            spent += 1
            if timing is None:
                continue
            trial_score = _objective(timing, trial, caps)
            if trial_score < score:
                score = trial_score
                orders, best, improved = trial, timing, True
                if on_better is not None:
                    on_better(best.makespan)
                break
    return orders, best
