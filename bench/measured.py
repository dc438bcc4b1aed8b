"""Measured: Megatron-Core's own schedules, torch.distributed.pipelining's and ours, on the
same sleep-op model (:mod:`.sleep_model`), the same data and the same forked CPU+gloo
ranks, interleaved step by step in one run of several launches.

Per launch every rank builds every schedule once, then runs ``warmup + steps`` rounds, each
schedule once a round behind a barrier, starting at a different schedule each round. Per
schedule and step it records the step time, each rank's busy and CPU time and, for ours,
the peak of live activations; ratios to the baseline are taken per round, and medians
quoted. Each schedule is also simulated with the same costs and ``latency_ms`` per hop.
Tables and plain statements of the results: :mod:`.measured_report`; the method, and why:
docs/benchmark-method.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from megatron_dualpipe.planner.torch_schedules import import_torch_schedule
from megatron_dualpipe.schedules import (
    CostModel,
    Kind,
    Placement,
    Schedule,
    SimResult,
    generate,
    lower,
    simulate,
)
from megatron_dualpipe.schedules.registry import OUR_SCHEDULES

from .launch import run_ranks
from .peers import as_torch_runs

__all__ = [
    "BASELINE",
    "OPTIMISED",
    "OPTIMISED_PEERS",
    "Calibration",
    "MEASURED_SCHEDULES",
    "MeasuredConfig",
    "MeasuredResult",
    "MeasuredRun",
    "ir_schedule",
    "measure",
]

#: The optimised DualPipeV.
OPTIMISED = "dualpipev-opt"
#: The optimiser's orders (run by our executor, measured only when asked for: they need
#: SciPy): name -> the measured schedules whose placements it is optimised on and whose
#: orders it starts from; it stays within the first one's peak of live activations.
OPTIMISED_PEERS: dict[str, tuple[str, ...]] = {
    OPTIMISED: ("dualpipev", "torch-zbv", "torch-dualpipev"),
    "zb1p-opt": ("zb1p", "megatron-interleaved", "torch-interleaved-zb"),
}
#: Name -> (who runs it, what it is). Table order; the first is the baseline.
MEASURED_SCHEDULES: dict[str, tuple[str, str]] = {
    "megatron-1f1b": ("megatron", "forward_backward_pipelining_without_interleaving"),
    "megatron-interleaved": ("megatron", "forward_backward_pipelining_with_interleaving"),
    "torch-1f1b": ("torch", "Schedule1F1B"),
    "torch-interleaved-zb": ("torch", "ScheduleInterleavedZeroBubble"),
    "torch-zbv": ("torch", "ScheduleZBVZeroBubble"),
    "torch-dualpipev": ("torch", "ScheduleDualPipeV"),
    **{name: ("ours", name) for name in OUR_SCHEDULES},
    # The work of the peers' placement in the order the optimiser finds for the
    # calibrated costs.
    **{
        name: ("ours", f"{peers[0]}'s placement, optimised")
        for name, peers in OPTIMISED_PEERS.items()
    },
}
BASELINE = "megatron-1f1b"
#: What the measured bench runs unless told otherwise.
DEFAULT_SCHEDULES = tuple(
    n for n in MEASURED_SCHEDULES if n not in OPTIMISED_PEERS and n != "torch-interleaved-zb"
)
#: Megatron's interleaved schedule: model chunks per rank.
INTERLEAVED_CHUNKS = 2


@dataclass(frozen=True)
class MeasuredConfig:
    """What to measure. ``share_ms``: F (= dX = dW) of one rank's share of the model.
    ``launches`` x (``warmup`` + ``steps``) rounds; the warm-up rounds are dropped.
    ``timeline``: one of ours whose step is recorded once more, untimed, at the end of the
    last launch, for the measured-vs-simulated figure (None: none)."""

    pp: int = 4
    microbatches: int = 16
    share_ms: float = 20.0
    layers_per_share: int = 2
    launches: int = 3
    steps: int = 3
    warmup: int = 1
    width: int = 16
    rows_per_microbatch: int = 2
    latency_ms: float = 0.2
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    timeline: str | None = "dualpipev"
    #: The first and the last model stage's costs x this (the bench's "uneven" profile:
    #: embedding, output layer and loss; 1.0: every stage even).
    end_scale: float = 1.0
    #: Measure the P2P latency and the per-action overhead first (one extra launch) and
    #: simulate with them (False: with ``latency_ms`` and no overhead).
    calibrate: bool = True
    timeout_s: float = 300.0
    pg_timeout_s: float = 60.0

    def layer_s(self) -> float:
        """Seconds each layer's F, dX and dW sleep."""
        return self.share_ms / 1000.0 / self.layers_per_share

    def cost(self) -> CostModel:
        """Per rank share, in ms, with the per-hop latency."""
        return CostModel(self.share_ms, self.share_ms, self.share_ms, latency=self.latency_ms)

    def stage_scale(self, placement: Placement, model_stage: int) -> float:
        """How much more a model stage's layers sleep than the even share."""
        ends = (0, placement.num_model_stages - 1)
        return self.end_scale if model_stage in ends else 1.0

    def cost_for(self, placement: Placement, calibration: Calibration | None = None) -> CostModel:
        """Per model stage of ``placement``, in ms: the even share scaled by
        :meth:`stage_scale`, plus the calibrated per-action overhead on each of F, B and W,
        with the calibrated latency (else ``latency_ms``)."""
        even = self.cost().per_stage(placement.num_ranks, placement.num_model_stages)
        overhead = calibration.overhead_ms if calibration else 0.0
        latency = calibration.latency_ms if calibration else self.latency_ms
        stages = tuple(
            tuple(
                part * self.stage_scale(placement, s) + overhead
                for part in (even.f, even.b, even.w)
            )
            for s in range(placement.num_model_stages)
        )
        return CostModel(latency=latency, stage_costs=stages)


@dataclass(frozen=True)
class Calibration:
    """What the machine adds to the sleeps: the one-way latency of a small message
    between two ranks (gloo ping-pong, median) and the mean time an F, B or W of our
    executor takes beyond its sleep (ms)."""

    latency_ms: float
    overhead_ms: float


#: ``python -m bench --quick``: 2 launches x (1 warm-up + 2 measured) rounds of the 8 schedules.
QUICK = MeasuredConfig(launches=2, steps=2)


@dataclass
class MeasuredResult:
    """One schedule's figures; times in ms.

    ``step_ms``: median over every measured step of every launch; ``vs_baseline``: median
    over rounds of this schedule's step over the baseline's in the same round; ``bubble``:
    per rank, median over steps of 1 - busy / step; ``bubble_vs_baseline``: mean bubble
    over the ranks over the baseline's. ``peak_activations`` (ours: measured, per rank,
    most over the steps) and ``simulated_peak`` count one stage's activations of one
    micro-batch as 1; ``stage_size`` converts them into units of a 1F1B stage's.
    ``runner``: the function or class that ran the step (Megatron: its schedule
    function's qualified name); ``losses``: micro-batch losses the last stage returned
    in its last step (Megatron: the length of its loss list)."""

    schedule: str
    source: str
    runner: str
    pp: int
    microbatches: int
    stages: int
    param_factor: float
    stage_size: float
    step_ms: float
    step_ms_all: list[float] = field(default_factory=list)
    vs_baseline: float = float("nan")
    busy_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    bubble: list[float] = field(default_factory=list)
    bubble_vs_baseline: float = float("nan")
    simulated_ms: float = 0.0
    simulated_bubble: list[float] = field(default_factory=list)
    peak_activations: list[int] | None = None
    simulated_peak: list[int] = field(default_factory=list)
    losses: int = 0

    @property
    def mean_bubble(self) -> float:
        return statistics.fmean(self.bubble) if self.bubble else float("nan")

    @property
    def vs_simulated(self) -> float:
        """Measured over simulated step time."""
        return self.step_ms / self.simulated_ms if self.simulated_ms else float("nan")


@dataclass
class MeasuredRun:
    """The results in table order, the figure's two results (ours measured and
    simulated, or None), the config and the load average before and after."""

    config: MeasuredConfig
    results: list[MeasuredResult]
    timeline: SimResult | None = None
    timeline_simulated: SimResult | None = None
    elapsed_s: float = 0.0
    load_before: tuple[float, ...] = ()
    load_after: tuple[float, ...] = ()
    #: Per measured round (launch by launch): schedule -> step time (ms).
    rounds: list[dict[str, float]] = field(default_factory=list)
    #: The machine's P2P latency and per-action overhead the simulation used (None: the
    #: config's ``latency_ms`` and no overhead).
    calibration: Calibration | None = None

    def by_name(self) -> dict[str, MeasuredResult]:
        return {r.schedule: r for r in self.results}

    def ratio(self, name: str, other: str) -> float:
        """Median over rounds of ``name``'s step time over ``other``'s in the same round."""
        values = [r[name] / r[other] for r in self.rounds if name in r and other in r]
        return statistics.median(values) if values else float("nan")

    def ratio_range(self, name: str, other: str) -> tuple[float, float]:
        """The least and most of those per-round ratios."""
        values = [r[name] / r[other] for r in self.rounds if name in r and other in r]
        return (min(values), max(values)) if values else (float("nan"), float("nan"))


# -- schedules in our IR (simulation, placement) ----------------------------------------
def compute_order(name: str, pp: int, microbatches: int) -> Schedule:
    """The compute order of measured schedule ``name`` in our IR (torch's as torch
    describes it), not lowered."""
    source, _ = MEASURED_SCHEDULES[name]
    if name in OPTIMISED_PEERS:
        raise ValueError(f"{name} depends on the costs: use optimised_schedule()")
    if source == "ours":
        return generate(name, pp, microbatches)
    if name == "megatron-1f1b":
        return generate("1f1b", pp, microbatches)
    if name == "megatron-interleaved":
        return generate("interleaved-1f1b", pp, microbatches, chunks=INTERLEAVED_CHUNKS)
    return import_torch_schedule(name, pp, microbatches)


def ir_schedule(name: str, pp: int, microbatches: int) -> Schedule:
    """The lowered IR schedule that runs (ours), or models (Megatron's, torch's: as torch
    runs it), ``name`` (not an optimised one: :func:`optimised_schedule`)."""
    schedule = compute_order(name, pp, microbatches)
    if MEASURED_SCHEDULES[name][0] == "torch":
        schedule = as_torch_runs(schedule)
    return lower(schedule)


def optimised_schedule(
    name: str, config: MeasuredConfig, calibration: Calibration | None
) -> Schedule:
    """The work of ``name``'s peers (:data:`OPTIMISED_PEERS`) reordered by the optimiser
    for the config's costs (calibrated where given): on each of the peers' placements,
    starting from the peers' orders, within the first peer's peak of live activations
    (our hand-made schedule's); the faster placement's result, lowered."""
    from megatron_dualpipe.planner.optimize import Effort, optimize_on_placements  # imports SciPy

    peers = [compute_order(n, config.pp, config.microbatches) for n in OPTIMISED_PEERS[name]]
    level = _peak_in_1f1b_stages(peers[0], config.cost_for(peers[0].placement, calibration))
    best = optimize_on_placements(
        peers,
        lambda placement: config.cost_for(placement, calibration),
        level,
        time_limit=60.0,
        effort=Effort(),
        name=name,
    )
    return lower(best.schedule)


def _peak_in_1f1b_stages(schedule: Schedule, cost: CostModel) -> float:
    """The most live activations any rank holds, in 1F1B stages' worth."""
    p = schedule.placement
    peak = max(r.peak_activations for r in simulate(schedule, cost).ranks)
    return peak * p.num_ranks / p.num_model_stages


def _schedules(config: MeasuredConfig, calibration: Calibration | None) -> dict[str, Schedule]:
    return {
        n: optimised_schedule(n, config, calibration)
        if n in OPTIMISED_PEERS
        else ir_schedule(n, config.pp, config.microbatches)
        for n in config.schedules
    }


def _stage_layers(config: MeasuredConfig, schedule: Schedule) -> int:
    p = schedule.placement
    layers, rest = divmod(config.layers_per_share * p.num_ranks, p.num_model_stages)
    if rest or layers < 1:
        raise ValueError(
            f"{schedule.name}: {config.layers_per_share} layers per rank share do not split "
            f"into {p.num_model_stages} stages over {p.num_ranks} ranks"
        )
    return layers


def _simulate(
    config: MeasuredConfig, schedule: Schedule, calibration: Calibration | None = None
) -> SimResult:
    return simulate(schedule, config.cost_for(schedule.placement, calibration))


# -- the ranks ---------------------------------------------------------------------------
def _data(config: MeasuredConfig):
    """The whole batch (every schedule gets the same): micro-batch i is rows
    ``[i * rows, (i + 1) * rows)``."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(config.microbatches * config.rows_per_microbatch, config.width, generator=gen)
    return x, torch.zeros_like(x)


class _Runner:
    """One schedule on one rank: ``step()`` runs one training step and returns what it
    reports (ours: peak live activations; all: the losses the last stage got). Gradients
    accumulate over the steps, as in gradient accumulation, alike for every runtime."""

    runner: str = ""

    def step(self) -> dict[str, Any]:
        raise NotImplementedError


class _TorchRunner(_Runner):
    def __init__(self, name: str, rank: int, config: MeasuredConfig, clock, schedule) -> None:
        from .peers import PeerConfig, _build

        peer = PeerConfig(
            pp=config.pp,
            microbatches=config.microbatches,
            share_ms=config.share_ms,
            layers_per_share=config.layers_per_share,
            width=config.width,
            rows_per_microbatch=config.rows_per_microbatch,
            end_scale=config.end_scale,
        )
        self.schedule, self.first, self.last = _build(name, rank, peer, clock)
        self.runner = type(self.schedule).__name__
        self.x, self.target = _data(config)

    def step(self) -> dict[str, Any]:
        losses: list[Any] = []
        args = (self.x,) if self.first else ()
        kwargs = {"target": self.target, "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        return {"losses": len(losses)}


class _OurRunner(_Runner):
    def __init__(
        self, name: str, rank: int, config: MeasuredConfig, clock, schedule: Schedule
    ) -> None:
        import torch

        from megatron_dualpipe.runtime import PipelineExecutor, TensorSpec
        from megatron_dualpipe.runtime.mirror import MirrorPair

        from .sleep_model import SleepCosts, SleepStage

        p = schedule.placement
        layers = _stage_layers(config, schedule)
        t = config.layer_s()
        modules = []
        for chunk in range(p.num_chunks):
            # Seeded by model stage: DualPipe's two copies of a stage start equal (built
            # afresh, not deep-copied, so that both sleep on this rank's clock).
            model_stage = p.model_stage(p.stage_of(rank, chunk))
            torch.manual_seed(model_stage)
            costs = SleepCosts(t, t, t).scaled(config.stage_scale(p, model_stage))
            modules.append(SleepStage(layers, config.width, costs, clock))
        self.modules = modules
        # DualPipe's copies exchange on a pair group of their own, made once, here.
        self.mirror = (
            MirrorPair(p, rank, timeout_s=config.pg_timeout_s) if p.kind == "mirror" else None
        )
        m = config.microbatches
        self.executor = PipelineExecutor(
            schedule,
            rank,
            modules,
            specs={
                s: TensorSpec((config.rows_per_microbatch, config.width))
                for s in range(p.num_stages)
            },
            loss_fn=lambda out, mb: (out**2).mean() / m,
            defer_weight_grads=True,
            timeout_s=config.pg_timeout_s,
        )
        self.runner = f"PipelineExecutor({name})"
        x, _ = _data(config)
        self.inputs = list(x.chunk(m))

    def step(self, record: bool = False) -> dict[str, Any]:
        result = self.executor.run(self.inputs, record_timeline=record)
        if self.mirror is not None:
            self.mirror.sync_grads(self.modules)
        return {"peak": result.peak_activations, "losses": len(result.losses), "result": result}


class _MegatronRunner(_Runner):
    def __init__(
        self, name: str, rank: int, config: MeasuredConfig, clock, schedule: Schedule
    ) -> None:
        import torch

        from megatron_dualpipe.megatron.model.module_chunks import module_chunks, mse_forward_step

        from .sleep_model import SleepCosts, SleepStage

        chunks = INTERLEAVED_CHUNKS if name == "megatron-interleaved" else 1
        if config.layers_per_share % chunks:
            raise ValueError(
                f"layers_per_share ({config.layers_per_share}) must divide into {chunks} chunks"
            )
        t = config.layer_s()
        layers = config.layers_per_share // chunks
        stages = []
        for chunk in range(chunks):
            model_stage = chunk * config.pp + rank  # stage weights seeded by stage index
            torch.manual_seed(model_stage)
            costs = SleepCosts(t, t, t).scaled(config.stage_scale(schedule.placement, model_stage))
            stages.append(SleepStage(layers, config.width, costs, clock))
        self.chunks, self.fn = module_chunks(
            stages,
            pp=config.pp,
            rank=rank,
            width=config.width,
            num_layers=config.pp * config.layers_per_share,
        )
        self.runner = f"{self.fn.__module__}.{self.fn.__qualname__}"
        self.forward_step = mse_forward_step
        x, _ = _data(config)
        rows = config.rows_per_microbatch
        # Megatron's activations are [sequence, micro-batch, hidden]: rows as the sequence.
        self.batches = [mb.reshape(rows, 1, config.width) for mb in x.chunk(config.microbatches)]
        self.seq_length, self.microbatches = rows, config.microbatches

    def step(self) -> dict[str, Any]:
        loss_dicts = self.fn(
            forward_step_func=self.forward_step,
            data_iterator=[iter(self.batches) for _ in self.chunks],
            model=self.chunks,
            num_microbatches=self.microbatches,
            seq_length=self.seq_length,
            micro_batch_size=1,
        )
        return {"losses": len(loss_dicts)}


def _make_runner(
    name: str, rank: int, config: MeasuredConfig, clock, schedule: Schedule
) -> _Runner:
    source = MEASURED_SCHEDULES[name][0]
    cls = {"torch": _TorchRunner, "ours": _OurRunner, "megatron": _MegatronRunner}[source]
    return cls(name, rank, config, clock, schedule)


def _round_order(names: list[str], round_index: int) -> list[str]:
    """``names`` rotated: each round starts with a different schedule."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def _measured_rank(
    rank: int,
    world_size: int,
    config: MeasuredConfig,
    launch: int,
    record: bool,
    verbose: bool,
    schedules: dict[str, Schedule],
) -> dict[str, Any]:
    """Worker body of one launch: build every schedule, run the rounds, return per
    schedule a list of per-step records and, if ``record``, the gathered timeline."""
    import contextlib

    import torch.distributed as dist

    from megatron_dualpipe.runtime import gather_timeline

    from .sleep_model import SleepClock

    names = list(config.schedules)
    with contextlib.ExitStack() as stack:
        if any(MEASURED_SCHEDULES[n][0] == "megatron" for n in names):
            from megatron_dualpipe.megatron.model.module_chunks import megatron_pipeline

            stack.enter_context(megatron_pipeline(config.pp, config.pg_timeout_s))
        clock = SleepClock()
        runners = {n: _make_runner(n, rank, config, clock, schedules[n]) for n in names}
        records: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for round_index in range(config.warmup + config.steps):
            order = _round_order(names, launch * (config.warmup + config.steps) + round_index)
            for name in order:
                runner = runners[name]
                dist.barrier()
                clock.reset()
                cpu = time.process_time()
                start = time.perf_counter()
                info = runner.step()
                end = time.perf_counter()
                info.pop("result", None)
                records[name].append(
                    {
                        "start": start,
                        "end": end,
                        "busy": clock.busy,
                        "cpu": time.process_time() - cpu,
                        "round": round_index,
                        **info,
                    }
                )
                if verbose and rank == 0:
                    tag = "warm-up" if round_index < config.warmup else "step"
                    print(
                        f"    launch {launch + 1} {tag} {round_index + 1}/"
                        f"{config.warmup + config.steps} {name:<21} rank 0: "
                        f"{1000 * (end - start):7.1f} ms",
                        flush=True,
                    )
        timeline = None
        if record and config.timeline in runners:
            runner = runners[config.timeline]
            assert isinstance(runner, _OurRunner)
            result = runner.step(record=True)["result"]
            timeline = gather_timeline(result.timeline, runner.executor.schedule)
        dist.barrier()
        return {
            "records": records,
            "runners": {n: r.runner for n, r in runners.items()},
            "timeline": timeline,
        }


def _calibration_rank(
    rank: int, world_size: int, config: MeasuredConfig, schedule: Schedule
) -> dict[str, Any]:
    """Worker body of the calibration launch: the ping-pong latency between ranks 0 and 1,
    then one warm-up and one recorded step of our hand-made DualPipeV, gathered on rank 0."""
    import torch.distributed as dist

    from megatron_dualpipe.runtime import gather_timeline, p2p_latency_s

    from .sleep_model import SleepClock

    latency_s = p2p_latency_s(rounds=50)
    runner = _OurRunner("dualpipev", rank, config, SleepClock(), schedule)
    runner.step()
    dist.barrier()
    result = runner.step(record=True)["result"]
    timeline = gather_timeline(result.timeline, runner.executor.schedule)
    return {"latency_ms": 1e3 * latency_s, "timeline": timeline}


def per_action_overhead_ms(measured: SimResult, cost: CostModel) -> float:
    """The mean time an F, B or W of ``measured`` took beyond its nominal duration under
    ``cost`` (ms)."""
    p = measured.schedule.placement
    extra = [
        (timed.end - timed.start) - cost.duration(timed.action, rank.rank, p.model_stage)
        for rank in measured.ranks
        for timed in rank.actions
        if timed.action.kind in (Kind.F, Kind.B, Kind.W)
    ]
    return statistics.fmean(extra) if extra else 0.0


def calibrate(config: MeasuredConfig) -> Calibration:
    """One launch of ``config.pp`` ranks: the P2P latency and per-action overhead of this
    machine, as the simulator takes them."""
    hand = lower(generate("dualpipev", config.pp, config.microbatches))
    ranks = run_ranks(
        _calibration_rank,
        config.pp,
        (config, hand),
        timeout_s=config.timeout_s,
        pg_timeout_s=config.pg_timeout_s,
    )
    timeline = next(r["timeline"] for r in ranks if r["timeline"] is not None)
    overhead = per_action_overhead_ms(timeline, config.cost_for(hand.placement))
    return Calibration(latency_ms=ranks[0]["latency_ms"], overhead_ms=max(0.0, overhead))


# -- the parent ----------------------------------------------------------------------------
def _prepare_parent(config: MeasuredConfig) -> None:
    """Import (and patch) what the workers need before forking, so they start warm; hide
    megatron-core's known warnings (as ``train`` does) in the parent and the ranks."""
    from megatron_dualpipe.megatron.compat.known_warnings import silence_known_warnings

    silence_known_warnings()
    import torch
    import torch.distributed.pipelining  # noqa: F401

    if any(MEASURED_SCHEDULES[n][0] == "megatron" for n in config.schedules):
        from megatron_dualpipe.megatron.model.module_chunks import prepare_megatron

        prepare_megatron()
    # The first backward from a non-scalar output imports torch.fx: pay it once, here.
    param = torch.nn.Parameter(torch.ones(2))
    torch.autograd.backward(param * 2, torch.ones(2))


def measure(config: MeasuredConfig | None = None, verbose: bool = False) -> MeasuredRun:
    """Launch ``config.pp`` ranks ``config.launches`` times, measure every schedule, and
    return their results. Raises ``BenchError`` if a rank fails or hangs."""
    import os

    config = config or MeasuredConfig()
    unknown = [n for n in config.schedules if n not in MEASURED_SCHEDULES]
    if unknown:
        raise ValueError(
            f"unknown measured schedule(s) {unknown}: choose from {list(MEASURED_SCHEDULES)}"
        )
    if config.schedules[0] != BASELINE:
        raise ValueError(f"the first schedule must be the baseline {BASELINE!r}")
    for name in config.schedules:
        if name not in OPTIMISED_PEERS:
            _stage_layers(config, ir_schedule(name, config.pp, config.microbatches))  # fail here
    load_before = os.getloadavg()
    start = time.perf_counter()
    _prepare_parent(config)
    calibration = calibrate(config) if config.calibrate else None
    if verbose and calibration is not None:
        print(
            f"    calibrated: P2P latency {calibration.latency_ms:.3f} ms, per-action overhead "
            f"{calibration.overhead_ms:.3f} ms",
            flush=True,
        )
    schedules = _schedules(config, calibration)
    launches = []
    for launch in range(config.launches):
        sys.stdout.flush()
        last = launch == config.launches - 1
        launches.append(
            run_ranks(
                _measured_rank,
                config.pp,
                (config, launch, last and config.timeline is not None, verbose, schedules),
                timeout_s=config.timeout_s,
                pg_timeout_s=config.pg_timeout_s,
            )
        )
    elapsed = time.perf_counter() - start
    return _summarise(
        config, schedules, launches, elapsed, load_before, os.getloadavg(), calibration
    )


def _summarise(
    config, schedules, launches, elapsed, load_before, load_after, calibration=None
) -> MeasuredRun:
    measured = range(config.warmup, config.warmup + config.steps)
    # (launch, round) -> schedule -> (step ms, per-rank busy ms, per-rank cpu ms)
    steps: dict[str, list[float]] = {n: [] for n in config.schedules}
    by_round: dict[tuple[int, int], dict[str, float]] = {}
    busy: dict[str, list[list[float]]] = {n: [[] for _ in range(config.pp)] for n in steps}
    cpu: dict[str, list[list[float]]] = {n: [[] for _ in range(config.pp)] for n in steps}
    bubble: dict[str, list[list[float]]] = {n: [[] for _ in range(config.pp)] for n in steps}
    peaks: dict[str, list[int]] = {}
    losses: dict[str, int] = {}
    for li, per_rank in enumerate(launches):
        for name in config.schedules:
            for i in measured:
                recs = [r["records"][name][i] for r in per_rank]
                step = 1000 * (max(r["end"] for r in recs) - min(r["start"] for r in recs))
                steps[name].append(step)
                by_round.setdefault((li, i), {})[name] = step
                for rank, rec in enumerate(recs):
                    busy[name][rank].append(1000 * rec["busy"])
                    cpu[name][rank].append(1000 * rec["cpu"])
                    bubble[name][rank].append(1 - 1000 * rec["busy"] / step)
                    if "peak" in rec:
                        peaks.setdefault(name, [0] * config.pp)
                        peaks[name][rank] = max(peaks[name][rank], rec["peak"])
                losses[name] = sum(rec.get("losses", 0) for rec in recs)
    runners = launches[0][0]["runners"]
    results = []
    for name in config.schedules:
        source = MEASURED_SCHEDULES[name][0]
        schedule = schedules[name]
        p = schedule.placement
        sim = _simulate(config, schedule, calibration)
        ratios = [r[name] / r[BASELINE] for r in by_round.values() if BASELINE in r]
        results.append(
            MeasuredResult(
                schedule=name,
                source=source,
                runner=runners[name],
                pp=config.pp,
                microbatches=config.microbatches,
                stages=p.num_stages,
                param_factor=p.param_factor,
                stage_size=p.num_ranks / p.num_model_stages,
                step_ms=statistics.median(steps[name]),
                step_ms_all=steps[name],
                vs_baseline=statistics.median(ratios),
                busy_ms=[statistics.median(b) for b in busy[name]],
                cpu_ms=[statistics.median(c) for c in cpu[name]],
                bubble=[statistics.median(b) for b in bubble[name]],
                simulated_ms=sim.makespan,
                simulated_bubble=[r.bubble_ratio for r in sim.ranks],
                peak_activations=peaks.get(name),
                simulated_peak=[r.peak_activations for r in sim.ranks],
                losses=losses[name],
            )
        )
    base = results[0].mean_bubble
    for r in results:
        r.bubble_vs_baseline = r.mean_bubble / base if base > 0 else float("nan")
    timeline = next((r["timeline"] for r in launches[-1] if r["timeline"] is not None), None)
    timeline_sim = None
    if timeline is not None:
        timeline_sim = _simulate(config, schedules[config.timeline], calibration)
    rounds = [by_round[key] for key in sorted(by_round)]
    return MeasuredRun(
        config,
        results,
        timeline,
        timeline_sim,
        elapsed,
        load_before,
        load_after,
        rounds,
        calibration,
    )
