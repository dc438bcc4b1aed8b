"""The optimiser: from a placement, a cost model and a memory cap, a schedule in our IR
with its proven lower bound, never worse than the best hand-made schedule it started from.

Steps, each within the time limit: the lower bound (:mod:`.bound`); candidates from the
hand-made schedules of the placement and from the list scheduler under a portfolio of
policies (:mod:`.listsched`); local search around the critical path on the best
(:mod:`.local_search`); the end of the schedule reordered exactly by HiGHS where time is
left (:mod:`.window_milp`); then validation and simulation of the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..cost import CostModel
from ..generators import GENERATORS
from ..ir import Placement, Schedule, ScheduleError
from ..simulate import SimResult, simulate
from ..validate import validate
from .bound import Bound, lower_bound, tails
from .instance import Instance
from .listsched import Policy, build
from .local_search import improve
from .timing import from_actions, time_orders, to_actions

__all__ = ["PORTFOLIO", "OptimizeResult", "hand_schedules", "optimize"]

#: Policies the list scheduler tries, most often best first (measured over the bench grid).
PORTFOLIO: tuple[Policy, ...] = (
    Policy(alternate=True, oldest_first=True, reserve=False),
    Policy(alternate=True, oldest_first=True),
    Policy(alternate=True, oldest_first=True, reserve=False, drain_eager_w=True),
    Policy(alternate=True, oldest_first=True, eager_w=True, reserve=False),
    Policy(alternate=True, reserve=False),
    Policy(alternate=True, lead=0),
    Policy(backward_first=True, lead=0),
    Policy(backward_first=False, lead=0),
    Policy(backward_first=True),
    Policy(backward_first=False, deep_first=False, lead=0),
    Policy(alternate=True, oldest_first=True, lead=1, reserve=False),
)
#: Pair modes tried with each policy where an FB pair is shorter than its halves.
_PAIR_MODES = (2, 1, 0)
#: Ops in the window the MILP reorders at the end of the schedule.
WINDOW_OPS = 40
#: Smallest time left (s) for which the window MILP is tried.
WINDOW_MIN_SECONDS = 2.0
#: Relative gap below which the search stops early.
GAP_TOLERANCE = 1e-9


@dataclass
class OptimizeResult:
    """The optimised schedule and the proof of how good it is.

    ``bound`` is a lower bound on the makespan of *any* schedule of the placement under
    the cost model (it ignores the memory cap, see :mod:`.bound`); ``gap`` is
    ``(makespan - bound) / makespan``, so the optimum is at most that fraction below the
    result. ``baseline`` is the best hand-made schedule of the placement (the warm
    start); ``fell_back`` says the search found nothing better within the cap and the
    baseline itself is returned."""

    schedule: Schedule
    result: SimResult
    baseline: Schedule
    baseline_result: SimResult
    bound: Bound
    caps: tuple[int, ...]
    solve_seconds: float
    fell_back: bool
    log: list[str] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return self.result.makespan

    @property
    def lower_bound(self) -> float:
        return self.bound.value

    @property
    def gap(self) -> float:
        return (self.makespan - self.lower_bound) / self.makespan if self.makespan else 0.0

    @property
    def peak_activations(self) -> int:
        return max(r.peak_activations for r in self.result.ranks)


def hand_schedules(placement: Placement) -> list[Schedule]:
    """Every hand-made schedule (ours) that runs on exactly ``placement``."""
    out = []
    for name in GENERATORS:
        try:
            schedule = GENERATORS[name](placement.num_ranks, placement.num_microbatches)
        except (ScheduleError, TypeError):
            continue
        if schedule.placement == placement:
            out.append(schedule)
    if placement.kind == "loop" and placement.num_chunks > 1:
        try:
            schedule = GENERATORS["interleaved-1f1b"](
                placement.num_ranks, placement.num_microbatches, chunks=placement.num_chunks
            )
        except ScheduleError:
            pass
        else:
            if schedule.placement == placement and schedule not in out:
                out.append(schedule)
    return out


def _caps(
    placement: Placement, memory_cap: int | Sequence[int] | None, baseline: SimResult | None
) -> tuple[int, ...]:
    ranks = placement.num_ranks
    if memory_cap is None:
        if baseline is None:
            raise ScheduleError(
                "no hand-made schedule runs on this placement, so there is no default memory "
                "cap: give one (--memory-cap N)"
            )
        return (max(r.peak_activations for r in baseline.ranks),) * ranks
    caps = (memory_cap,) * ranks if isinstance(memory_cap, int) else tuple(memory_cap)
    if len(caps) != ranks:
        raise ScheduleError(f"memory caps name {len(caps)} ranks, the placement has {ranks}")
    least = 2 if placement.num_chunks > 1 and placement.kind != "mirror" else 1
    if min(caps) < least:
        raise ScheduleError(
            f"a memory cap of {min(caps)} activations is too small for the {placement.kind} "
            f"placement: each rank needs at least {least} (one micro-batch's stages on it); "
            "raise --memory-cap"
        )
    return caps


def _variants(cost: CostModel) -> list[tuple[str, CostModel]]:
    """The costs the list scheduler builds under: as given, and without what makes one
    rank or one hop differ (an order built for even stages and free messages is often
    the better one to run under the real costs; every order is timed under them)."""
    out = [("as given", cost)]
    if cost.latency:
        out.append(("no-latency", replace(cost, latency=0.0)))
        out.append(("double-latency", replace(cost, latency=2 * cost.latency)))
    if cost.stage_scale is not None or cost.rank_scale is not None:
        out.append(("even-stage", replace(cost, stage_scale=None, rank_scale=None)))
    if len(out) == 4:
        out.append(("nominal", replace(cost, latency=0.0, stage_scale=None, rank_scale=None)))
    return out


def _check_placement(placement: Placement) -> None:
    if placement.kind == "loop" and placement.num_chunks > 2:
        raise ScheduleError(
            f"the optimiser handles loop placements with 1 or 2 stages per rank, got "
            f"{placement.num_chunks}: use --chunks 2"
        )


def optimize(
    placement: Placement,
    cost: CostModel,
    *,
    memory_cap: int | Sequence[int] | None = None,
    time_limit: float = 10.0,
    warm_starts: Sequence[Schedule] = (),
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> OptimizeResult:
    """Optimise the per-rank order of ``placement``'s work under ``cost`` (per stage, as
    the simulator takes it) within ``memory_cap`` live activations per rank (one int for
    every rank, or one per rank; default: the peak of the best hand-made schedule of the
    placement), spending at most about ``time_limit`` seconds.

    ``warm_starts`` adds schedules of the same placement to the hand-made ones. The
    result is validated and simulated; it is never slower than the best warm start that
    keeps the cap (that one is returned, with ``fell_back`` set, if nothing better is
    found). Raises :class:`ScheduleError` with one sentence for an unsupported placement,
    a cap too small to run it, or warm starts of another placement."""
    import scipy.optimize  # noqa: F401  (imported before the clock starts: a one-off cost)

    say = progress or (lambda _line: None)
    _check_placement(placement)
    cost.check_fits(placement.num_model_stages, placement.num_ranks)
    for schedule in warm_starts:
        if schedule.placement != placement:
            raise ScheduleError(
                f"warm start {schedule.name} runs on {schedule.placement}, not {placement}"
            )
    start = time.perf_counter()
    deadline = start + time_limit
    starts = [*hand_schedules(placement), *warm_starts]
    simulated = [(s, simulate(s, cost)) for s in starts]
    simulated.sort(key=lambda pair: pair[1].makespan)
    baseline = simulated[0] if simulated else None
    caps = _caps(placement, memory_cap, baseline[1] if baseline else None)
    inst = Instance(placement, cost, caps)
    bound = lower_bound(inst)
    log = [f"lower bound {bound.value:.6g} (rank {bound.rank}, {bound.methods[bound.rank]})"]
    say(log[-1])

    def fits(peaks: Sequence[int]) -> bool:
        return all(p <= c for p, c in zip(peaks, caps, strict=True))

    # Candidates: (makespan, orders, where from).
    candidates: list[tuple[float, list, str]] = []
    feasible_start = None
    for schedule, result in simulated:
        if fits([r.peak_activations for r in result.ranks]):
            orders = from_actions(inst, schedule.compute_only().ranks)
            candidates.append((result.makespan, orders, f"hand-made {schedule.name}"))
            if feasible_start is None:
                feasible_start = (schedule, result)

    def best_makespan() -> float:
        return min((c[0] for c in candidates), default=float("inf"))

    def close_enough() -> bool:
        best = best_makespan()
        return best < float("inf") and (best - bound.value) <= GAP_TOLERANCE * best

    pairs = any(inst.any_pair_pays(r) for r in range(inst.num_ranks))
    policies = [
        replace(p, pair=mode) for p in PORTFOLIO for mode in (_PAIR_MODES if pairs else (0,))
    ]
    variants = [(name, Instance(placement, c, caps)) for name, c in _variants(cost)]
    priorities = {name: tails(v) for name, v in variants}
    build_seconds = 0.0
    tried = 0
    for i, policy in enumerate(policies):
        for variant, vinst in variants:
            if close_enough() or (tried and time.perf_counter() + build_seconds > deadline):
                break
            t0 = time.perf_counter()
            built = build(vinst, policy, priorities[variant])
            tried += 1
            if built is not None and fits(built.peaks):
                orders = from_actions(inst, built.ranks)
                timed = built if variant == "as given" else time_orders(inst, orders)
                label = f"list scheduler, policy {i}, {variant} costs"
                candidates.append((timed.makespan, orders, label))
            build_seconds = max(build_seconds, time.perf_counter() - t0)
    if not candidates:
        raise ScheduleError(
            f"no schedule of this placement fits a memory cap of {min(caps)} activations "
            "per rank: raise --memory-cap"
        )
    candidates.sort(key=lambda c: c[0])
    say(f"best of {len(candidates)} candidates: {candidates[0][0]:.6g} ({candidates[0][2]})")
    makespan, orders, origin = candidates[0]
    timing = time_orders(inst, orders)
    if not close_enough() and time.perf_counter() < deadline:
        orders, timing = improve(inst, orders, deadline)
        log.append(f"local search: {makespan:.6g} -> {timing.makespan:.6g}")
        say(log[-1])
    left = deadline - time.perf_counter()
    if (
        left >= WINDOW_MIN_SECONDS
        and (timing.makespan - bound.value) > GAP_TOLERANCE * timing.makespan
    ):
        from .window_milp import reorder_window

        new = reorder_window(inst, orders, timing, limit=WINDOW_OPS, time_limit=left / 2)
        if new is not None:
            new_timing = time_orders(inst, new)
            if (
                new_timing is not None
                and fits(new_timing.peaks)
                and new_timing.makespan < timing.makespan - 1e-12
            ):
                log.append(f"window MILP: {timing.makespan:.6g} -> {new_timing.makespan:.6g}")
                say(log[-1])
                orders, timing = improve(inst, new, deadline)
    label = name or (f"{feasible_start[0].name}-opt" if feasible_start else "optimised")
    schedule = Schedule(label, placement, to_actions(inst, orders), list(caps))
    validate(schedule, dry_run=False)
    result = simulate(schedule, cost)
    fell_back = False
    if feasible_start is not None and result.makespan >= feasible_start[1].makespan - 1e-12:
        base = feasible_start[0]
        schedule = Schedule(label, placement, base.compute_only().ranks, list(caps))
        result = simulate(schedule, cost)
        fell_back = True
        log.append(f"nothing better than {base.name} found: returning it")
        say(log[-1])
    solve = time.perf_counter() - start
    if baseline is None:
        baseline = (schedule, result)
    return OptimizeResult(
        schedule, result, baseline[0], baseline[1], bound, caps, solve, fell_back, log
    )
