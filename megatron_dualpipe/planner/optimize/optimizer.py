"""The optimiser: from a placement, a cost model and a memory cap, a schedule in our IR
with its proven lower bound, never worse than the best hand-made schedule it started from.

Steps, each within the time limit: the lower bound (:mod:`.bound`); candidates from the
hand-made schedules of the placement and from the list scheduler under a portfolio of
policies (:mod:`.listsched`); local search around the critical path on the best
(:mod:`.local_search`); the end of the schedule reordered exactly by HiGHS where time is
left (:mod:`.window_milp`); then validation and simulation of the result.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from ...schedules.cost import CostModel
from ...schedules.ir import Placement, Schedule, ScheduleError
from ...schedules.limits import optimize_size_problem
from ...schedules.registry import SCHEDULES
from ...schedules.simulate import SimResult, simulate
from ...schedules.validate import validate
from .bound import Bound, lower_bound, tails
from .deadline import Deadline, OutOfTime
from .instance import Instance
from .listsched import Policy, build
from .local_search import improve, pair_adjacent
from .timing import Timing, from_actions, time_orders, to_actions

__all__ = ["PORTFOLIO", "Effort", "OptimizeResult", "hand_schedules", "optimize"]

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
#: Pair modes tried with each policy where an FB pair is shorter than its halves (full
#: backward paired, none, dX only: the second matters where memory is tight).
_PAIR_MODES = (2, 0, 1)
#: The policy built, whatever the time, when nothing else gave a candidate: it keeps a
#: unit free for each returning micro-batch (no deadlock where each channel carries one
#: stage's messages).
SAFE_POLICY = Policy(alternate=True, oldest_first=True)
#: Ops in the window the MILP reorders at the end of the schedule.
WINDOW_OPS = 40
#: Smallest time left (s) for which the window MILP is tried.
WINDOW_MIN_SECONDS = 2.0
#: Relative gap below which the search stops early.
GAP_TOLERANCE = 1e-9
#: Share of the search time the list scheduler may use; the rest is for improving.
CONSTRUCT_SHARE = 0.6


@dataclass(frozen=True)
class Effort:
    """A budget in work instead of seconds, so that a search ends the same on any machine
    under any load (benchmarks and tests use it; the time limit still stops it):
    ``builds`` list-scheduler orders, ``evaluations`` local-search timings (each pass of
    the search), ``milp_nodes`` branch-and-bound nodes of the window MILP."""

    builds: int = 24
    evaluations: int = 150
    milp_nodes: int = 400


@dataclass
class OptimizeResult:
    """The optimised schedule and the proof of how good it is.

    ``bound`` is a lower bound on the makespan of *any* schedule of the placement under
    the cost model (it ignores the memory cap, see :mod:`.bound`); ``gap`` is
    ``(makespan - bound) / makespan``, so the optimum is at most that fraction below the
    result. ``baseline`` is the best hand-made schedule of the placement (the warm
    start); ``fell_back`` says the search found nothing better within the cap and the
    baseline itself is returned; ``cut`` says what the time limit cut short."""

    schedule: Schedule
    result: SimResult
    baseline: Schedule
    bound: Bound
    caps: tuple[int, ...]
    solve_seconds: float
    fell_back: bool
    log: list[str] = field(default_factory=list)
    #: The time limit, what it cut short (empty: nothing), and the seconds until the search
    #: stopped (the rest of ``solve_seconds`` validated and simulated the result).
    time_limit: float = float("inf")
    cut: tuple[str, ...] = ()
    search_seconds: float = 0.0

    @cached_property
    def baseline_result(self) -> SimResult:
        """The warm start simulated under the same costs (computed when first asked; its
        figures alone)."""
        return simulate(self.baseline, self.result.cost, timeline=False)

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
    """Every hand-made schedule (ours, from the registry) that runs on ``placement``."""
    return list(_hand_schedules(placement))


def _hand_schedules(
    placement: Placement, generated: Sequence[Schedule] = ()
) -> Iterator[Schedule]:
    """:func:`hand_schedules`, each generated when asked for; one the caller has
    ``generated`` already (named as its registry entry) is taken as it is."""
    ranks, microbatches = placement.num_ranks, placement.num_microbatches
    known = {s.name: s for s in generated if s.placement == placement}
    for name, entry in SCHEDULES.items():
        if entry.placement != placement.kind or not entry.is_legal(ranks, microbatches):
            continue
        if name in known:
            yield known[name]
            continue
        options = {"chunks": placement.num_chunks} if entry.chunks is None else {}
        try:
            schedule = entry.generate(ranks, microbatches, **options)
        except ScheduleError:
            continue  # e.g. interleaved 1F1B asked for one chunk
        if schedule.placement == placement:
            yield schedule


def _caps(
    inst: Instance, memory_cap: int | Sequence[int] | None, baseline_peak: int | None
) -> tuple[int, ...]:
    placement = inst.placement
    ranks = placement.num_ranks
    if memory_cap is None:
        if baseline_peak is None:
            raise ScheduleError(
                "no hand-made schedule runs on this placement, so there is no default memory "
                "cap: give one (--memory-cap N)"
            )
        return (baseline_peak,) * ranks
    caps = (memory_cap,) * ranks if isinstance(memory_cap, int) else tuple(memory_cap)
    if len(caps) != ranks:
        raise ScheduleError(f"memory caps name {len(caps)} ranks, the placement has {ranks}")
    least = 2 if any(inst.revisits) else 1  # a micro-batch coming back holds two at once
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
    uneven = cost.stage_scale is not None or cost.rank_scale is not None
    if uneven or cost.stage_costs is not None:
        even = replace(cost, stage_scale=None, rank_scale=None)
        if cost.stage_costs is not None:  # every stage at the mean of the given ones
            n = len(cost.stage_costs)
            mean = tuple(sum(c[i] for c in cost.stage_costs) / n for i in range(3))
            if cost.stage_a2a is None:
                even = replace(even, stage_costs=None, f=mean[0], b=mean[1], w=mean[2])
            else:  # and the mean all-to-all: pairs still cost by their streams
                a2a = tuple(sum(a[i] for a in cost.stage_a2a) / n for i in range(2))
                even = replace(even, stage_costs=(mean,) * n, stage_a2a=(a2a,) * n)
        out.append(("even-stage", even))
        if cost.latency:
            out.append(("nominal", replace(even, latency=0.0)))
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
    effort: Effort | None = None,
    generated: Sequence[Schedule] = (),
    timeline: bool = True,
) -> OptimizeResult:
    """Optimise the per-rank order of ``placement``'s work under ``cost`` (per stage, as
    the simulator takes it) within ``memory_cap`` live activations per rank (one int for
    every rank, or one per rank; default: the peak of the best hand-made schedule of the
    placement), spending about ``time_limit`` seconds at most.

    ``warm_starts`` adds schedules of the same placement to the hand-made ones, and
    ``generated`` gives hand-made ones the caller has built already (not built again: at
    PP x micro-batches in the hundreds of thousands that takes seconds); ``effort`` bounds
    the search by work (reproducible) as well as by time. The result is validated and
    simulated (``timeline=False``: its figures alone, the simulator's faster mode); it is
    never slower than the best warm start that keeps the cap (that one is returned, with
    ``fell_back`` set, if nothing better is found). Raises :class:`ScheduleError` with one
    sentence for an unsupported placement, a cap too small to run it, or warm starts of
    another placement."""
    try:
        import scipy.optimize  # noqa: F401  (imported before the clock starts: a one-off cost)
    except ModuleNotFoundError:
        raise ScheduleError(
            "the schedule optimiser needs SciPy (its HiGHS solver), which is not installed: "
            "pip install 'megatron-dualpipe[planner]' (or pip install scipy)"
        ) from None

    _check_placement(placement)
    too_large = optimize_size_problem(
        placement.num_ranks, placement.num_microbatches, placement.num_chunks
    )
    if too_large is not None:
        raise ScheduleError(too_large)
    cost.check_fits(placement.num_model_stages, placement.num_ranks)
    for schedule in warm_starts:
        if schedule.placement != placement:
            raise ScheduleError(
                f"warm start {schedule.name} runs on {schedule.placement}, not {placement}"
            )
    search = _Search(placement, cost, time_limit, progress, effort)
    search.warm_start(
        [s.compute_only() for s in warm_starts], _hand_schedules(placement, generated)
    )
    search.set_caps(_caps(search.inst, memory_cap, search.baseline_peak))
    search.prove_bound()
    search.construct()
    search.improve()
    return search.result(name, time_limit, timeline)


def optimize_on_placements(
    orders: Sequence[Schedule],
    cost_for: Callable[[Placement], CostModel],
    peak: float,
    **options,
) -> OptimizeResult:
    """:func:`optimize` on each placement of ``orders``, starting from the orders of that
    placement, within ``peak`` live activations in 1F1B stages' worth (the same memory on
    every placement); the fastest result. ``options`` go to :func:`optimize`."""
    best = None
    for placement in dict.fromkeys(s.placement for s in orders):
        result = optimize(
            placement,
            cost_for(placement),
            memory_cap=int(peak * placement.num_model_stages / placement.num_ranks + 1e-9),
            warm_starts=[s for s in orders if s.placement == placement],
            **options,
        )
        if best is None or result.makespan < best.makespan - 1e-12:
            best = result
    return best


class _Search:
    """One optimisation's state: the instance, the candidates and the clock."""

    def __init__(
        self,
        placement: Placement,
        cost: CostModel,
        time_limit: float,
        progress: Callable[[str], None] | None,
        effort: Effort | None,
    ):
        self.placement, self.cost, self.effort = placement, cost, effort
        self.start = time.perf_counter()
        self.deadline = self.start + time_limit
        #: What the time limit cut short, in words for the summary.
        self.cut: list[str] = []
        self.say = progress or (lambda _line: None)
        self.log: list[str] = []
        # Caps are set once the warm starts are known (their peak is the default).
        self.inst = Instance(placement, cost, (0,) * placement.num_ranks)
        self.starts: list[tuple[Schedule, list, Timing]] = []
        self.candidates: list[tuple[float, list, str]] = []
        self.bound: Bound | None = None
        self.orders: list | None = None
        self.timing: Timing | None = None

    def note(self, line: str) -> None:
        self.log.append(line)
        self.say(line)

    # -- steps ----------------------------------------------------------------------
    def warm_start(self, given: list[Schedule], hand_made: Iterator[Schedule]) -> None:
        """Time the ``given`` warm starts, then the hand-made schedules (each generated when
        its turn comes, an order given already skipped), while time is left: the first
        whatever the time (its peak is the default cap). Keep them best first. The final
        validation and simulation cost about ten timings: that much is kept free at the end."""
        t0 = time.perf_counter()
        timed = 0
        for schedule in itertools.chain(given, hand_made):
            if timed and time.perf_counter() >= self.deadline:
                self.cut.append(f"timed {timed} of the warm starts")
                break
            if any(schedule.ranks == start.ranks for start, _, _ in self.starts):
                continue  # each order timed once
            orders = from_actions(self.inst, schedule.ranks)
            timing = time_orders(self.inst, orders)
            timed += 1
            if timing is not None:
                self.starts.append((schedule, orders, timing))
        self.starts.sort(key=lambda s: s[2].makespan)
        per_timing = (time.perf_counter() - t0) / max(1, timed)
        self.deadline -= 10 * per_timing

    @property
    def baseline_peak(self) -> int | None:
        return max(self.starts[0][2].peaks) if self.starts else None

    def set_caps(self, caps: tuple[int, ...]) -> None:
        """Keep the warm starts within ``caps`` as candidates, each also with its adjacent
        forwards and backwards paired where pairs pay."""
        self.inst.caps = caps
        pairs = any(self.inst.any_pair_pays(r) for r in range(self.inst.num_ranks))
        clock = Deadline(self.deadline)
        for schedule, orders, timing in self.starts:
            if self._fits(timing.peaks):
                self.candidates.append((timing.makespan, orders, f"hand-made {schedule.name}"))
            if pairs and not clock.passed():
                paired = pair_adjacent(self.inst, orders)
                try:
                    paired_timing = time_orders(self.inst, paired, clock)
                except OutOfTime:
                    continue
                if paired_timing is not None and self._fits(paired_timing.peaks):
                    where = f"hand-made {schedule.name}, adjacent F and B paired"
                    self.candidates.append((paired_timing.makespan, paired, where))

    def prove_bound(self) -> None:
        self.bound = lower_bound(self.inst)
        b = self.bound
        self.note(f"lower bound {b.value:.6g} (rank {b.rank}, {b.methods[b.rank]})")

    def construct(self) -> None:
        """The list scheduler under each policy of the portfolio and each cost variant,
        while time is left and no candidate has reached the bound."""
        inst = self.inst
        pairs = any(inst.any_pair_pays(r) for r in range(inst.num_ranks))
        modes = _PAIR_MODES if pairs else (0,)
        first = [replace(p, pair=mode) for mode in modes[:2] for p in PORTFOLIO[:2]]
        rest = [replace(p, pair=mode) for p in PORTFOLIO for mode in modes]
        policies = list(dict.fromkeys(first + rest))
        variants = [
            (label, Instance(self.placement, c, inst.caps)) for label, c in _variants(self.cost)
        ]
        priorities = {label: tails(v) for label, v in variants}
        now = time.perf_counter()
        stop = now + CONSTRUCT_SHARE * max(0.0, self.deadline - now)
        clock = Deadline(stop)
        builds = [(i, p, label, v) for i, p in enumerate(policies) for label, v in variants]
        slowest, tried = 0.0, 0
        for i, policy, label, vinst in builds:
            now = time.perf_counter()
            if self._closed() or (self.effort is not None and tried >= self.effort.builds):
                break
            if now >= stop or (tried and now + slowest > stop):
                self.cut.append(f"built {tried} of {len(builds)} list-scheduler orders")
                break
            try:
                built = build(vinst, policy, priorities[label], clock)
                tried += 1
                if built is not None and self._fits(built.peaks):
                    orders = from_actions(inst, built.ranks)
                    makespan = (
                        built.makespan
                        if vinst.cost == inst.cost
                        else time_orders(inst, orders, clock).makespan
                    )
                    where = f"list scheduler, policy {i}, {label} costs"
                    self.candidates.append((makespan, orders, where))
            except OutOfTime:
                self.cut.append(f"built {tried} of {len(builds)} list-scheduler orders")
                break
            slowest = max(slowest, time.perf_counter() - now)
        if not self.candidates:
            built = build(inst, SAFE_POLICY, priorities[variants[0][0]])
            if built is not None and self._fits(built.peaks):
                self.candidates.append((built.makespan, from_actions(inst, built.ranks), "safe"))
        if not self.candidates:
            raise ScheduleError(
                f"no schedule of this placement fits a memory cap of {min(inst.caps)} "
                "activations per rank: raise --memory-cap"
            )
        self.candidates.sort(key=lambda c: c[0])
        best = self.candidates[0]
        self.note(f"best of {len(self.candidates)} candidates: {best[0]:.6g} ({best[2]})")
        self.orders = best[1]

    def improve(self) -> None:
        """Local search; then, with time left, the window MILP and local search again."""
        if self._closed():
            return
        try:
            if time.perf_counter() >= self.deadline:
                raise OutOfTime
            self.timing = time_orders(self.inst, self.orders, Deadline(self.deadline))
        except OutOfTime:
            self.cut.append("no local search")
            return
        evaluations = None if self.effort is None else self.effort.evaluations
        before = self.timing.makespan
        self.orders, self.timing = improve(
            self.inst, self.orders, self.deadline, evaluations=evaluations, timing=self.timing
        )
        self.note(f"local search: {before:.6g} -> {self.timing.makespan:.6g}")
        if time.perf_counter() >= self.deadline and not self._closed():
            self.cut.append("the local search stopped")
        left = self.deadline - time.perf_counter()
        if self._closed() or (left < WINDOW_MIN_SECONDS and self.effort is None):
            return
        from .window_milp import reorder_window

        new = reorder_window(
            self.inst,
            self.orders,
            self.timing,
            limit=WINDOW_OPS,
            time_limit=left / 2,
            node_limit=None if self.effort is None else self.effort.milp_nodes,
        )
        timing = None if new is None else time_orders(self.inst, new)
        if timing is None or not self._fits(timing.peaks):
            self.note("window MILP: no better end found")
            return
        self.note(f"window MILP: {self.timing.makespan:.6g} -> {timing.makespan:.6g}")
        if timing.makespan < self.timing.makespan - 1e-12:
            self.orders, self.timing = improve(
                self.inst, new, self.deadline, evaluations=evaluations
            )

    def result(self, name: str | None, time_limit: float, timeline: bool) -> OptimizeResult:
        """Validate and simulate the best orders; fall back to the best warm start that
        keeps the cap where they are not faster (simulated once: the search's best orders
        are often that start's own)."""
        searched = time.perf_counter() - self.start
        caps = list(self.inst.caps)
        label = name or (f"{self.starts[0][0].name}-opt" if self.starts else "optimised")
        fallback = next((s for s in self.starts if self._fits(s[2].peaks)), None)
        result = None
        if fallback is None or self.orders is not fallback[1]:
            orders = to_actions(self.inst, self.orders)
            schedule = Schedule(label, self.placement, orders, caps)
            schedule = schedule.with_weight_grads_in_b_order()
            validate(schedule, dry_run=False)
            result = simulate(schedule, self.cost, timeline=timeline)
        fell_back = fallback is not None and (
            result is None or result.makespan >= fallback[2].makespan - 1e-12
        )
        if fell_back:
            schedule = Schedule(label, self.placement, fallback[0].ranks, caps)
            schedule = schedule.with_weight_grads_in_b_order()
            result = simulate(schedule, self.cost, timeline=timeline)
            self.note(f"nothing better than {fallback[0].name} found: returning it")
        baseline = self.starts[0][0] if self.starts else schedule
        found = OptimizeResult(
            schedule,
            result,
            baseline,
            self.bound,
            tuple(caps),
            time.perf_counter() - self.start,
            fell_back,
            self.log,
            time_limit=time_limit,
            cut=tuple(self.cut),
            search_seconds=searched,
        )
        if fell_back and baseline is fallback[0]:  # the same orders: simulated once
            found.__dict__["baseline_result"] = result
        return found

    # -- helpers --------------------------------------------------------------------
    def _fits(self, peaks: Sequence[int]) -> bool:
        return all(p <= c for p, c in zip(peaks, self.inst.caps, strict=True))

    def _closed(self) -> bool:
        """Whether a candidate has reached the lower bound."""
        best = (
            self.timing.makespan
            if self.timing
            else min((c[0] for c in self.candidates), default=float("inf"))
        )
        return best < float("inf") and best - self.bound.value <= GAP_TOLERANCE * best
