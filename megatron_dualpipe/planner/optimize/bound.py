"""A proven lower bound on the makespan of any schedule of an instance.

Every action gets a *head* (a time before which it cannot start in any schedule) and a
*tail* (a time that must pass after it ends before the step can end); each rank alone is
then relaxed to one preemptive machine that respects them and ignores the memory cap and
the other ranks, solved by Jackson's rule where no FB pair pays, else by a linear program
(HiGHS, via scipy.optimize.linprog). Any real schedule is feasible for each relaxation, so
their least makespans bound it. Why it holds: docs/optimizer.md, "The lower bound, and why
it holds".
"""

from __future__ import annotations

from dataclasses import dataclass

from .instance import Instance

__all__ = ["Bound", "Group", "lower_bound", "rank_groups", "tails"]

_INF = float("inf")


@dataclass(frozen=True)
class Group:
    """``count`` identical jobs of one rank: what they are (``kind`` F, B or W of
    ``stage``), their head, processing time unpaired and tail."""

    kind: str
    stage: int
    count: int
    head: float
    time: float
    tail: float


@dataclass(frozen=True)
class Bound:
    """The bound, each rank's value, and how each was proven (``jackson`` or ``lp``)."""

    value: float
    per_rank: tuple[float, ...]
    methods: tuple[str, ...]

    @property
    def rank(self) -> int:
        """The rank whose relaxation gives the bound."""
        return max(range(len(self.per_rank)), key=self.per_rank.__getitem__)


def _least_pair(inst: Instance, stage: int, forward: bool) -> float:
    """The shortest FB pair holding ``stage``'s forward (or backward)."""
    own = inst.stages_of[inst.rank[stage]]
    if forward:
        return min(inst.pair[(stage, sb, bw)] for sb in own for bw in (False, True))
    return min(inst.pair[(sf, stage, bw)] for sf in own for bw in (False, True))


def tails(inst: Instance) -> tuple[list[float], list[float]]:
    """Per stage: the least time from the end of its forward, and from the end of its
    backward's dX, to the end of the step."""
    n = len(inst.rank)
    lat = inst.cost.latency
    e_f = [min(inst.f[s], _least_pair(inst, s, True)) for s in range(n)]
    e_b = [min(inst.b[s], _least_pair(inst, s, False)) for s in range(n)]
    q_b = [0.0] * n
    q_f = [0.0] * n
    for s in _path_order(inst):
        q = inst.prev[s]
        q_b[s] = 0.0 if q is None else (lat if inst.prev_remote[s] else 0.0) + e_b[q] + q_b[q]
    for s in reversed(_path_order(inst)):
        q = inst.next[s]
        if q is None:
            q_f[s] = e_b[s] + q_b[s]
        else:
            q_f[s] = (lat if inst.next_remote[s] else 0.0) + e_f[q] + q_f[q]
    return q_f, q_b


def _path_order(inst: Instance) -> list[int]:
    """Stages such that each comes after its previous stage."""
    return sorted(range(len(inst.rank)), key=lambda s: _depth(inst, s))


def _depth(inst: Instance, s: int) -> int:
    d = 0
    while inst.prev[s] is not None:
        s, d = inst.prev[s], d + 1
    return d


def heads(inst: Instance) -> tuple[list[float], list[float]]:
    """Per stage: the earliest start of its forward and of its backward. A forward that
    ends before its rank's earliest backward can start cannot be paired, so it takes its
    full time; iterating from "every forward may pair" tightens the heads monotonically,
    each round a valid bound."""
    n = len(inst.rank)
    lat = inst.cost.latency
    order = _path_order(inst)
    pf = [_least_pair(inst, s, True) for s in range(n)]
    e_b = [min(inst.b[s], _least_pair(inst, s, False)) for s in range(n)]
    first_backward = [0.0] * inst.num_ranks
    h_f, h_b = [0.0] * n, [0.0] * n
    for _ in range(2 * n + 2):
        for s in order:
            q = inst.prev[s]
            if q is None:
                h_f[s] = 0.0
            else:
                tb = first_backward[inst.rank[q]]
                end = min(h_f[q] + inst.f[q], max(h_f[q], tb) + pf[q])
                h_f[s] = end + (lat if inst.prev_remote[s] else 0.0)
        for s in reversed(order):
            q = inst.next[s]
            if q is None:
                tb = first_backward[inst.rank[s]]
                h_b[s] = min(h_f[s] + inst.f[s], max(h_f[s], tb) + pf[s])
            else:
                h_b[s] = h_b[q] + e_b[q] + (lat if inst.next_remote[s] else 0.0)
        new = [min(h_b[s] for s in own) for own in inst.stages_of]
        if new == first_backward:
            break
        first_backward = new
    return h_f, h_b


def rank_groups(
    inst: Instance,
    rank: int,
    chains: tuple[tuple[list[float], list[float]], tuple[list[float], list[float]]] | None = None,
) -> list[Group]:
    """The jobs of ``rank``'s one-machine relaxation; ``chains`` is ``(heads(inst),
    tails(inst))`` where the caller has them."""
    (h_f, h_b), (q_f, q_b) = chains or (heads(inst), tails(inst))
    out = []
    for s in inst.stages_of[rank]:
        count = len(inst.mbs[s])
        e_b = min(inst.b[s], _least_pair(inst, s, False))
        out.append(Group("F", s, count, h_f[s], inst.f[s], q_f[s]))
        out.append(Group("B", s, count, h_b[s], inst.b[s], q_b[s]))
        out.append(Group("W", s, count, h_b[s] + e_b, inst.w[s], 0.0))
    return [g for g in out if g.count]


def jackson(groups: list[Group]) -> float:
    """Least makespan of one machine with preemption, heads and tails (Jackson's rule:
    always run the released work with the longest tail)."""
    left = {i: g.count * g.time for i, g in enumerate(groups)}
    releases = sorted({g.head for g in groups})
    t, best = 0.0, 0.0
    while any(v > 1e-15 for v in left.values()):
        ready = [i for i, v in left.items() if v > 1e-15 and groups[i].head <= t + 1e-12]
        if not ready:
            t = min(r for r in releases if r > t)
            continue
        i = max(ready, key=lambda j: groups[j].tail)
        upcoming = [r for r in releases if r > t + 1e-12]
        run = left[i] if not upcoming else min(left[i], upcoming[0] - t)
        t += run
        left[i] -= run
        if left[i] <= 1e-15:
            best = max(best, t + groups[i].tail)
    return best


def _pair_lp(inst: Instance, rank: int, groups: list[Group]) -> float | None:
    """The relaxation with pairing, as one LP in the makespan C; None where its window
    order assumption (every head before every C - tail) does not hold at the optimum."""
    import numpy as np
    from scipy.optimize import linprog

    fixed = sorted({0.0, *(g.head for g in groups)})
    last = fixed[-1]
    ends = sorted({g.tail for g in groups}, reverse=True)  # windows [C - q_i, C - q_{i+1}]
    q_max = ends[0]
    # Windows: fixed [a, b]; the middle [last, C - q_max]; then tail windows.
    windows = [("fixed", a, b) for a, b in zip(fixed, fixed[1:], strict=False)]
    windows.append(("middle", last, q_max))
    windows += [("tail", a, b) for a, b in zip(ends, [*ends[1:], 0.0], strict=True) if a > b]

    def open_for(g: Group, w: tuple[str, float, float]) -> bool:
        kind, a, b = w
        if kind == "fixed":
            return a >= g.head - 1e-12
        if kind == "middle":
            return True
        return b >= g.tail - 1e-12  # window [C - a, C - b] ends by C - tail

    own = inst.stages_of[rank]
    by_key = {(g.kind, g.stage): i for i, g in enumerate(groups)}
    pairs = [
        (sf, sb, bw)
        for sf in own
        for sb in own
        for bw in (False, True)
        if inst.pair_pays(sf, sb, bw) and ("F", sf) in by_key and ("B", sb) in by_key
    ]
    columns: list[tuple] = []  # ("u", group, window) or ("y", pair, window)
    for wi, w in enumerate(windows):
        for gi, g in enumerate(groups):
            if open_for(g, w):
                columns.append(("u", gi, wi))
        for pi, (sf, sb, _) in enumerate(pairs):
            if open_for(groups[by_key[("F", sf)]], w) and open_for(groups[by_key[("B", sb)]], w):
                columns.append(("y", pi, wi))
    n = len(columns) + 1  # the last column is C
    a_eq = np.zeros((len(groups), n))
    b_eq = np.array([float(g.count) for g in groups])
    a_ub = np.zeros((len(windows) + 1, n))
    b_ub = np.zeros(len(windows) + 1)
    for j, (what, index, wi) in enumerate(columns):
        if what == "u":
            a_eq[index, j] = 1.0
            a_ub[wi, j] = groups[index].time
        else:
            sf, sb, bw = pairs[index]
            a_eq[by_key[("F", sf)], j] = 1.0
            a_eq[by_key[("B", sb)], j] = 1.0
            if bw:
                a_eq[by_key[("W", sb)], j] = 1.0
            a_ub[wi, j] = inst.pair[pairs[index]]
    for wi, (kind, a, b) in enumerate(windows):
        if kind == "middle":
            a_ub[wi, -1] = -1.0
            b_ub[wi] = -b - a  # sum <= C - q_max - last
        else:
            b_ub[wi] = b - a if kind == "fixed" else a - b
    a_ub[-1, -1] = -1.0
    b_ub[-1] = -(last + q_max)  # the window order: C >= last head + longest tail
    cost = np.zeros(n)
    cost[-1] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, method="highs")
    if res.status != 0:
        return None
    value = float(res.x[-1])
    if value <= last + q_max + 1e-9:
        return None  # the order assumption binds: not a valid bound
    return value


def lower_bound(inst: Instance) -> Bound:
    """The largest of the ranks' relaxation bounds."""
    values, methods = [], []
    chains = (heads(inst), tails(inst))
    for r in range(inst.num_ranks):
        groups = rank_groups(inst, r, chains)
        value, method = jackson(groups), "jackson"
        if inst.any_pair_pays(r):
            # Jackson with every action at its paired share is valid; the LP is tighter.
            shares = _paired_shares(inst, r, groups)
            value = jackson(shares)
            lp = _pair_lp(inst, r, groups)
            if lp is not None and lp > value:
                value, method = lp, "lp"
        values.append(value)
        methods.append(method)
    return Bound(max(values), tuple(values), tuple(methods))


def _paired_shares(inst: Instance, rank: int, groups: list[Group]) -> list[Group]:
    """The groups with each job at the least share of any pair it could be part of: a pair
    (F, B[W]) of duration P is charged as F * P/(F+B[+W]) and so on, rho = the least such
    ratio over the rank's pairs (capped at 1)."""
    own = inst.stages_of[rank]
    rho = 1.0
    for sf in own:
        for sb in own:
            for bw in (False, True):
                alone = inst.f[sf] + inst.b[sb] + (inst.w[sb] if bw else 0.0)
                if alone > 0:
                    rho = min(rho, inst.pair[(sf, sb, bw)] / alone)
    return [Group(g.kind, g.stage, g.count, g.head, g.time * rho, g.tail) for g in groups]
