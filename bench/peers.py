"""Measured peers: torch.distributed.pipelining's own runtime running its schedules on
sleep-op stages (:mod:`.sleep_model`), one forked CPU+gloo process per rank.

All schedules run in one launch, interleaved step by step (a barrier before each step),
so slow phases of the shared machine hit them alike. Per schedule: the step time (first
start to last end over the ranks) of each step after the warm-up steps, and each rank's
busy time (the time its sleeps took). Each is set against the simulator on the same
imported schedule, as torch runs it (:func:`as_torch_runs`), with the same costs and a
small per-hop latency.

Costs: every layer's F, dX and dW sleep ``share_ms / layers_per_share``; a rank's share
of the model is ``layers_per_share`` layers, so a 1F1B stage has all of them and a V
stage (two per rank) half. The model is the same for every schedule.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

from megatron_dualpipe.planner.report import markdown_table
from megatron_dualpipe.planner.torch_schedules import TORCH_SCHEDULES, import_torch_schedule
from megatron_dualpipe.schedules import CostModel, Kind, Placement, Schedule, simulate

from .launch import run_ranks

__all__ = ["PeerConfig", "PeerResult", "as_torch_runs", "measure_peers", "peers_table"]


@dataclass(frozen=True)
class PeerConfig:
    """What to measure. ``share_ms``: F (= dX = dW) of one rank's share of the model."""

    pp: int = 4
    microbatches: int = 16
    share_ms: float = 20.0
    layers_per_share: int = 2
    steps: int = 5
    warmup: int = 1
    width: int = 16
    rows_per_microbatch: int = 2
    latency_ms: float = 0.2
    schedules: tuple[str, ...] = ("torch-1f1b", "torch-zbv", "torch-dualpipev")
    #: The first and the last stage's sleeps x this (1.0: every stage even).
    end_scale: float = 1.0
    timeout_s: float = 240.0

    def layer_s(self) -> float:
        """Seconds each layer's F, dX and dW sleep."""
        return self.share_ms / 1000.0 / self.layers_per_share


@dataclass(frozen=True)
class PeerResult:
    """One schedule's measurement (milliseconds) and its simulated counterpart."""

    schedule: str
    pp: int
    microbatches: int
    step_ms: float  # median over the measured steps
    step_ms_all: list[float] = field(default_factory=list)
    busy_ms: list[float] = field(default_factory=list)  # per rank, median over steps
    cpu_ms: list[float] = field(default_factory=list)  # per rank, median over steps
    simulated_ms: float = 0.0
    simulated_busy_ms: float = 0.0

    @property
    def ratio(self) -> float:
        """Measured over simulated step time."""
        return self.step_ms / self.simulated_ms if self.simulated_ms else float("nan")


def _mse(output, target):
    return ((output - target) ** 2).mean()


def _build(name: str, rank: int, config: PeerConfig, clock):
    """This rank's PipelineStage(s) and the torch schedule object for ``name``."""
    import torch
    from torch.distributed.pipelining import PipelineStage, schedules

    from .sleep_model import SleepCosts, SleepStage

    spec = TORCH_SCHEDULES[name]
    chunks = spec.chunks_for(None)
    if config.layers_per_share % chunks:
        raise ValueError(f"{name}: layers_per_share must be a multiple of {chunks}")
    placement = Placement(spec.placement, config.pp, chunks * config.pp, config.microbatches)
    t = config.layer_s()
    stages = []
    for chunk in range(chunks):
        index = placement.stage_of(rank, chunk)
        torch.manual_seed(index)
        end = index in (0, placement.num_stages - 1)
        costs = SleepCosts(t, t, t).scaled(config.end_scale if end else 1.0)
        module = SleepStage(config.layers_per_share // chunks, config.width, costs, clock)
        stages.append(PipelineStage(module, index, placement.num_stages, torch.device("cpu")))
    cls = getattr(schedules, spec.class_name)
    schedule = cls(stages[0] if chunks == 1 else stages, config.microbatches, loss_fn=_mse)
    first = any(s.stage_index == 0 for s in stages)
    last = any(s.stage_index == placement.num_stages - 1 for s in stages)
    return schedule, first, last


def _peer_rank(rank: int, world_size: int, config: PeerConfig, verbose: bool) -> dict:
    """Worker body: build every schedule, run them interleaved, return per schedule a list
    of ``(start, end, busy, cpu)`` per step: ``time.perf_counter`` seconds (one clock for
    every process of this machine), the time slept, and the process's CPU time (all its
    threads: the runtime's own cost, which competes for the cores)."""
    import torch
    import torch.distributed as dist

    from .sleep_model import SleepClock

    clock = SleepClock()
    runners = {name: _build(name, rank, config, clock) for name in config.schedules}
    gen = torch.Generator().manual_seed(0)
    batch = config.microbatches * config.rows_per_microbatch
    x = torch.randn(batch, config.width, generator=gen)
    target = torch.zeros(batch, config.width)
    records: dict[str, list[tuple[float, float, float, float]]] = {n: [] for n in runners}
    for step in range(config.warmup + config.steps):
        for name, (schedule, first, last) in runners.items():
            args = (x,) if first else ()
            kwargs = {"target": target, "losses": []} if last else {}
            dist.barrier()
            clock.reset()
            cpu = time.process_time()
            start = time.perf_counter()
            schedule.step(*args, **kwargs)
            end = time.perf_counter()
            records[name].append((start, end, clock.busy, time.process_time() - cpu))
            if verbose and rank == 0:
                tag = "warm-up" if step < config.warmup else "step"
                print(
                    f"    {tag} {step + 1}/{config.warmup + config.steps} {name:<16} "
                    f"rank 0: {1000 * (end - start):7.1f} ms",
                    flush=True,
                )
    dist.barrier()
    return records


def _simulated(name: str, config: PeerConfig) -> tuple[float, float]:
    """Simulated makespan and busiest rank's busy time (ms) of ``name`` as torch runs it."""
    schedule = as_torch_runs(import_torch_schedule(name, config.pp, config.microbatches))
    share = config.share_ms
    p = schedule.placement
    cost = CostModel(share, share, share, latency=config.latency_ms)
    result = simulate(schedule, cost.per_stage(p.num_ranks, p.num_model_stages))
    return result.makespan, max(r.busy for r in result.ranks)


def measure_peers(config: PeerConfig | None = None, verbose: bool = False) -> list[PeerResult]:
    """Launch ``config.pp`` ranks, measure every schedule in ``config.schedules``, and
    return one :class:`PeerResult` each. Raises ``BenchError`` if a rank fails or hangs."""
    config = config or PeerConfig()
    for name in config.schedules:
        if name not in TORCH_SCHEDULES:
            raise ValueError(f"unknown torch schedule {name!r}")
    # Imported here, before the fork, so that the workers start warm.
    import torch.distributed.pipelining  # noqa: F401

    sys.stdout.flush()
    per_rank = run_ranks(_peer_rank, config.pp, (config, verbose), timeout_s=config.timeout_s)
    results = []
    for name in config.schedules:
        steps = range(config.warmup, config.warmup + config.steps)
        step_ms = [
            1000 * (max(r[name][i][1] for r in per_rank) - min(r[name][i][0] for r in per_rank))
            for i in steps
        ]
        busy = [1000 * statistics.median(r[name][i][2] for i in steps) for r in per_rank]
        cpu = [1000 * statistics.median(r[name][i][3] for i in steps) for r in per_rank]
        sim_ms, sim_busy = _simulated(name, config)
        results.append(
            PeerResult(
                name,
                config.pp,
                config.microbatches,
                statistics.median(step_ms),
                step_ms,
                busy,
                cpu,
                sim_ms,
                sim_busy,
            )
        )
    return results


def peers_table(results: list[PeerResult]) -> str:
    """A markdown table: per schedule the median measured step, its spread, the simulated
    step, their ratio, the ratio to the first schedule's measured step, and per-rank busy
    (slept) and CPU time ranges."""
    if not results:
        return ""
    base = results[0].step_ms
    header = [
        "schedule",
        "measured (ms)",
        "min-max",
        "simulated (ms)",
        "measured/sim.",
        f"vs {results[0].schedule}",
        "busy/rank (ms)",
        "sim. busy",
        "CPU/rank (ms)",
    ]
    rows = [
        [
            r.schedule,
            f"{r.step_ms:.1f}",
            f"{min(r.step_ms_all):.0f}-{max(r.step_ms_all):.0f}",
            f"{r.simulated_ms:.1f}",
            f"{r.ratio:.3f}",
            f"{r.step_ms / base:.3f}",
            f"{min(r.busy_ms):.0f}-{max(r.busy_ms):.0f}",
            f"{r.simulated_busy_ms:.0f}",
            f"{min(r.cpu_ms):.0f}-{max(r.cpu_ms):.0f}",
        ]
        for r in results
    ]
    first = results[0]
    title = (
        f"**torch.distributed.pipelining on sleep ops, PP={first.pp}, "
        f"micro-batches={first.microbatches}** (median of {len(first.step_ms_all)} steps)"
    )
    return title + "\n\n" + markdown_table(header, rows)


def as_torch_runs(schedule: Schedule) -> Schedule:
    """The order torch's runtime really executes: its first stage (stage 0, whose input
    needs no gradient) skips the dX pass and runs the whole backward at its W. Each stage-0
    B is dropped and its W becomes a BW; everything else is unchanged."""
    ranks = []
    for actions in schedule.ranks:
        out = []
        for a in actions:
            if a.stage == 0 and a.kind is Kind.B:
                continue
            if a.stage == 0 and a.kind is Kind.W:
                a = a._replace(kind=Kind.BW)
            out.append(a)
        ranks.append(out)
    return Schedule(f"{schedule.name} (as run)", schedule.placement, ranks)
