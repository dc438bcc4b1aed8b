"""The end of the schedule reordered exactly by mixed-integer programming (SciPy's HiGHS,
``scipy.optimize.milp``).

:func:`reorder_window` takes every op that starts at or after a time T (at most ``limit``
ops: each rank's suffix) and finds the order of it with the least makespan, keeping
dependencies, each stage's micro-batch order and the memory cap, given everything before
T. The solution is re-timed as soon as possible in its order; the caller keeps it only if
it is better. The formulation: docs/optimizer.md, "Method" (window MILP).
"""

from __future__ import annotations

import bisect
import itertools

from .instance import Instance
from .timing import BW, FB, FBW, F, Op, Timing, W, channels, duration, halves

__all__ = ["reorder_window"]


def _fixed_before(inst: Instance, a: Op, b: Op) -> bool:
    """Whether ``a`` must run before ``b`` on their (common) rank by a dependency or a
    stage's micro-batch order."""
    af, ab = halves(a)
    bf, bb = halves(b)
    # stage chains in micro-batch order
    if af and bf and (af[0] == bf[0] and af[1] < bf[1]):
        return True
    if ab and bb and (ab[0] == bb[0] and ab[1] < bb[1]):
        return True
    if a[0] == W and b[0] == W and a[1] == b[1] and a[2] < b[2]:
        return True
    # data on this rank
    if af and bb and af == bb:
        return True  # a forward before its own backward
    if af and bf and inst.next[af[0]] == bf[0] and af[1] == bf[1]:
        return True
    if ab and bb and inst.prev[ab[0]] == bb[0] and ab[1] == bb[1]:
        return True
    return bool(ab and b[0] == W and ab == (b[1], b[2]))


def reorder_window(
    inst: Instance,
    orders: list[list[Op]],
    timing: Timing,
    *,
    limit: int,
    time_limit: float,
    node_limit: int | None = None,
) -> list[list[Op]] | None:
    """New orders with the last ``limit`` ops reordered optimally, or None if HiGHS found
    no solution within ``time_limit`` seconds (or ``node_limit`` branch-and-bound nodes:
    then the best solution found, deterministically)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    starts = sorted(t for row in timing.start for t in row)
    t0 = starts[-limit] if len(starts) > limit else 0.0
    lat = inst.cost.latency
    prefix, window, free_at, live0 = [], [], [], []
    for r, order in enumerate(orders):
        cut = bisect.bisect_left(timing.start[r], t0 - 1e-12)
        prefix.append(order[:cut])
        window.append(order[cut:])
        free_at.append(timing.end[r][cut - 1] if cut else 0.0)
        live = 0
        for op in order[:cut]:
            if op[0] == F or op[0] >= FB:
                live += 1
            if op[0] in (W, BW, FBW):
                live -= 1
        live0.append(live)
    produced: dict[tuple[str, int, int], tuple] = {}
    for r, order in enumerate(prefix):
        for i, op in enumerate(order):
            fwd, back = halves(op)
            if fwd:
                produced[("F", *fwd)] = ("fixed", timing.end[r][i])
            if back:
                produced[("B", *back)] = ("fixed", timing.end[r][i])
    col: dict[tuple[int, int], int] = {}
    n = 0
    for r, ops in enumerate(window):
        for j, op in enumerate(ops):
            col[(r, j)] = n
            n += 1
            fwd, back = halves(op)
            if fwd:
                produced[("F", *fwd)] = ("op", r, j)
            if back:
                produced[("B", *back)] = ("op", r, j)
    dur = {key: duration(inst, window[key[0]][key[1]]) for key in col}
    span = (max(timing.finish) - t0) + max(dur.values(), default=0.0) + 1.0
    big = span + max(free_at) - t0 + 1.0
    pairs: dict[tuple[int, int, int], int] = {}
    fixed: list[tuple[int, int, int]] = []
    for r, ops in enumerate(window):
        for i, j in itertools.combinations(range(len(ops)), 2):
            shared = inst.shared_channels and channels(inst, ops[i]) & channels(inst, ops[j])
            if shared or _fixed_before(inst, ops[i], ops[j]):
                fixed.append((r, i, j))  # a shared channel keeps the current order
            elif _fixed_before(inst, ops[j], ops[i]):
                fixed.append((r, j, i))
            else:
                pairs[(r, i, j)] = n
                n += 1
    c_index = n
    n += 1
    rows, lo, hi = [], [], []
    inf = np.inf

    def add(coeffs: dict[int, float], low: float, high: float) -> None:
        rows.append(coeffs)
        lo.append(low)
        hi.append(high)

    for (r, j), cj in col.items():
        add({cj: 1.0}, free_at[r], inf)
        add({c_index: 1.0, cj: -1.0}, dur[(r, j)], inf)
        op = window[r][j]
        fwd, back = halves(op)
        needs = []
        if fwd and inst.prev[fwd[0]] is not None:
            needs.append(
                (("F", inst.prev[fwd[0]], fwd[1]), lat if inst.prev_remote[fwd[0]] else 0.0)
            )
        if back:
            q = inst.next[back[0]]
            if q is None:
                needs.append((("F", back[0], back[1]), 0.0))
            else:
                needs.append((("B", q, back[1]), lat if inst.next_remote[back[0]] else 0.0))
        for key, hop in needs:
            source = produced[key]
            if source[0] == "fixed":
                add({cj: 1.0}, source[1] + hop, inf)
            else:
                _, rr, jj = source
                if (rr, jj) == (r, j):
                    continue
                add({cj: 1.0, col[(rr, jj)]: -1.0}, dur[(rr, jj)] + hop, inf)
    for r, i, j in fixed:
        add({col[(r, j)]: 1.0, col[(r, i)]: -1.0}, dur[(r, i)], inf)
    # Valid cuts that tighten the relaxation: a rank's window work fits between its
    # free time and C; an op's fixed successors on its rank follow it.
    followers: dict[tuple[int, int], float] = {}
    for r, i, j in fixed:
        followers[(r, i)] = followers.get((r, i), 0.0) + dur[(r, j)]
    for r, ops in enumerate(window):
        if ops:
            add({c_index: 1.0}, free_at[r] + sum(dur[(r, j)] for j in range(len(ops))), inf)
        for j in range(len(ops)):
            add({c_index: 1.0, col[(r, j)]: -1.0}, dur[(r, j)] + followers.get((r, j), 0.0), inf)
    for (r, i, j), y in pairs.items():
        ci, cj = col[(r, i)], col[(r, j)]
        # s_j - s_i - big*y >= d_i - big ; s_i - s_j + big*y >= d_j
        add({cj: 1.0, ci: -1.0, y: -big}, dur[(r, i)] - big, inf)
        add({ci: 1.0, cj: -1.0, y: big}, dur[(r, j)], inf)
    # Memory before each forward: live0 + forwards before - frees before + 1 <= cap.
    fixed_pairs = set(fixed)
    for r, ops in enumerate(window):
        for j, op in enumerate(ops):
            if not (op[0] == F or op[0] >= FB):
                continue
            coeffs: dict[int, float] = {}
            const = live0[r] + 1
            for i, other in enumerate(ops):
                if i == j:
                    continue
                alloc = 1 if other[0] == F or other[0] >= FB else 0
                free = 1 if other[0] in (W, BW, FBW) else 0
                delta = alloc - free
                if not delta:
                    continue
                if (r, i, j) in fixed_pairs:
                    const += delta
                elif (r, j, i) in fixed_pairs:
                    continue
                else:
                    key = (r, min(i, j), max(i, j))
                    y = pairs[key]
                    if i < j:  # y = 1: i before j
                        coeffs[y] = coeffs.get(y, 0.0) + delta
                    else:  # y = 1: j before i, so i before j is 1 - y
                        const += delta
                        coeffs[y] = coeffs.get(y, 0.0) - delta
            add(coeffs, -inf, inst.caps[r] - const)
    matrix = np.zeros((len(rows), n))
    for i, coeffs in enumerate(rows):
        for c, v in coeffs.items():
            matrix[i, c] += v
    cost = np.zeros(n)
    cost[c_index] = 1.0
    integrality = np.zeros(n)
    upper = np.full(n, inf)
    for y in pairs.values():
        integrality[y] = 1
        upper[y] = 1
    upper[c_index] = timing.makespan + 1e-9  # the incumbent bounds the search
    res = milp(
        cost,
        constraints=LinearConstraint(matrix, np.array(lo), np.array(hi)),
        integrality=integrality,
        bounds=Bounds(np.zeros(n), upper),
        options={
            "time_limit": max(0.05, time_limit),
            "disp": False,
            **({"node_limit": node_limit} if node_limit is not None else {}),
        },
    )
    if res.x is None:
        return None
    new = []
    for r, ops in enumerate(window):
        ranked = sorted(range(len(ops)), key=lambda j: (res.x[col[(r, j)]], j))
        new.append(prefix[r] + [ops[j] for j in ranked])
    return new
