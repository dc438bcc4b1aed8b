"""The benchmark run: its sections in order, printed as they go, and optionally written as
JSON and as a markdown document with its figures.

A section is a function ``(BenchContext) -> Section`` registered in :data:`SECTIONS`;
``simulated`` (every schedule through the simulator), ``measured`` (Megatron-Core's
schedules, torch's and ours measured in one interleaved run on sleep ops) and ``peers``
(torch's runtime alone, with CPU times; left out of ``--quick``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEEPSEEK_TITLE",
    "QUICK_SKIPS",
    "SECTIONS",
    "BenchContext",
    "Section",
    "replace_section",
    "run",
]

Progress = Callable[[str], None]


@dataclass
class BenchContext:
    """What every section gets: the grid size, where files go (None: nowhere) and where
    progress lines and tables are printed."""

    quick: bool = False
    out_dir: Path | None = None
    progress: Progress = print


@dataclass
class Section:
    """A section's result: a title, its markdown (tables, figure links relative to the
    output folder) and its data for the JSON file."""

    key: str
    title: str
    markdown: str
    data: Any = field(default=None)


# -- simulated ---------------------------------------------------------------------------
SIM_PPS_QUICK = (4, 8)
SIM_PPS_FULL = (4, 8, 16)
SIM_MICROBATCH_MULTIPLES = (2, 4, 8)

_SIM_INTRO = """\
Every schedule runs through the same discrete-event simulator. Costs are given for one
rank's share of the model (F, B = dX, W = dW) and divided among a schedule's stages, so
schedules with more, smaller stages run the same model. Profiles: F=B=W; W=0.5B;
F&B=0.7(F+B+W) (an overlapped forward + full backward pair takes 0.7 of its parts:
MoE-style overlap; only DualPipe(V) issue such pairs); ends 1.5x (F=B=W, the first and
the last model stage 1.5x for the embedding and the output layer + loss: rank 0's two
stages under the V, the first and last rank's under a loop, each end rank's under the
mirror); P2P latency 5% of F (F=B=W, every message 0.05). Columns: T = makespan in units
of one rank share's F; bubble = idle over all ranks' time; vs 1F1B = T over our 1F1B's T;
bubble removed vs 1F1B = (1F1B's T - T) / 1F1B's bubble (its T minus its busiest rank's
compute; above 100%: less compute too, from F&B overlap); peak act. = the most live
activations on a rank, in units of one 1F1B stage's activations of one micro-batch
(largest over the micro-batch counts); params = parameters per rank over an even 1/PP
share; vs compute bound = T over the schedule's compute bound (as `simulate`'s vs bound:
all its F, B and W compute shared evenly over the ranks, as if no rank ever waited; the
line under each table gives the bound), below 1x only where F&B pairs take less than their
parts' compute (F&B=0.7). The lower bound row is not the compute bound: it is the least
busiest-rank compute time among the schedules (that work with no idle). `torch-*` rows
are torch.distributed.pipelining's generators imported into our IR and validated.

`*-opt` rows are the optimiser (docs/optimizer.md), warm-started only from our hand-made
schedules of that placement (never from torch's), each search with a fixed effort ({builds}
list-scheduler orders, {evaluations} local-search timings per pass, {nodes} MILP nodes: the
same table on any machine under any load), at {up_to}PP micro-batches and fewer (n/a in the
larger column):
`dualpipev-opt` on the V, `zb1p-opt` on the loop (one and two stages per rank, the faster
kept: see the stages column), `dualpipe-opt` on the mirror. Each runs under the least peak
activations among the table's schedules of its placement, so it holds no more than any of
them; where a schedule of that placement holding more is still faster, a second row runs
under that schedule's peak ("dualpipev-opt, dualpipev's memory")."""


_GAPS_INTRO = """\
**Optimiser: proven gap and solve time.** Per optimiser row, (T - bound) / T, where the
bound holds for every schedule of that placement under those costs (it ignores the memory
cap; docs/optimizer.md says how it is proven); `*`: within 1% of the best achievable. In
brackets: the solve time (lower bound, candidates, local search, MILP) on this machine."""


def simulated_section(ctx: BenchContext) -> Section:
    """Simulate the grid, print a table per (profile, PP) as it completes, draw a figure
    per profile."""
    from .plots import plot_bubbles
    from .profiles import PROFILES
    from .simulated import (
        OPTIMISED_UP_TO,
        OPTIMISER_EFFORT,
        OPTIMISER_SECONDS,
        optimiser_table,
        simulate_group,
        simulated_table,
    )

    pps = SIM_PPS_QUICK if ctx.quick else SIM_PPS_FULL
    effort = OPTIMISER_EFFORT
    intro = _SIM_INTRO.format(
        builds=effort.builds,
        evaluations=effort.evaluations,
        nodes=effort.milp_nodes,
        up_to=OPTIMISED_UP_TO,
    )
    parts, rows = [intro], []
    for profile in PROFILES:
        profile_rows = []
        for pp in pps:
            counts = [k * pp for k in SIM_MICROBATCH_MULTIPLES]
            group = simulate_group(
                profile,
                pp,
                counts,
                progress=ctx.progress,
                optimise=True,
                time_limit=OPTIMISER_SECONDS,
                effort=OPTIMISER_EFFORT,
            )
            table = simulated_table(group, profile)
            ctx.progress("\n" + table + "\n")
            parts.append(table)
            profile_rows += group
        if ctx.out_dir is not None:
            path = ctx.out_dir / f"bench_sim_bubble_{profile.key}.png"
            plot_bubbles(profile_rows, path, profile.label)
            ctx.progress(f"  wrote {path}")
            parts.append(f"![bubble ratio, {profile.label}]({path.name})")
        rows += profile_rows
    gaps = optimiser_table(rows)
    ctx.progress("\n" + _GAPS_INTRO + "\n\n" + gaps + "\n")
    parts += [_GAPS_INTRO, gaps]
    return Section(
        "simulated",
        "Simulated: every schedule, one simulator",
        "\n\n".join(parts),
        {"pps": list(pps), "rows": [asdict(r) for r in rows]},
    )


# -- measured peers ----------------------------------------------------------------------
_PEERS_INTRO = """\
torch.distributed.pipelining's own runtime, one CPU+gloo process per rank, on stages whose
layers sleep for F, dX and dW (two autograd nodes per layer, so dX and dW passes sleep
separately); a rank's share of the model is {layers} layers of {layer_ms:g} ms per pass
(F=B=W={share:g} ms per rank share). All schedules run in one launch, interleaved step by
step, {warmup} warm-up step(s) first. Step time: first start to last end over the ranks.
Simulated: the same imported schedule as torch runs it (its first stage does its whole
backward at W), same costs, {latency:g} ms per hop. busy: time a rank slept; CPU: the
rank's CPU time in the step (torch's runtime and gloo), which competes for this machine's
{cores} cores. Load average before the run: {load}."""


def peers_section(ctx: BenchContext) -> Section:
    """Measure torch's Schedule1F1B, ScheduleZBVZeroBubble and ScheduleDualPipeV."""
    from .peers import PeerConfig, measure_peers, peers_table

    config = PeerConfig()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    ctx.progress(
        f"  launching {config.pp} ranks: {', '.join(config.schedules)}; "
        f"{config.warmup} + {config.steps} steps each (load average {load})"
    )
    results = measure_peers(config, verbose=True)
    table = peers_table(results)
    ctx.progress("\n" + table + "\n")
    intro = _PEERS_INTRO.format(
        layers=config.layers_per_share,
        layer_ms=1000 * config.layer_s(),
        share=config.share_ms,
        warmup=config.warmup,
        latency=config.latency_ms,
        cores=os.cpu_count(),
        load=load,
    )
    data = {
        "config": asdict(config),
        "load_average": os.getloadavg(),
        "results": [{**asdict(r), "ratio": r.ratio} for r in results],
    }
    return Section(
        "peers", "Measured peers: torch.distributed.pipelining", intro + "\n\n" + table, data
    )


# -- measured: Megatron, torch and ours --------------------------------------------------
_MEASURED_INTRO = """\
One run, one sleep model, one data set, one machine: Megatron-Core's own 1F1B and
interleaved 1F1B ({chunks} chunks), run by its schedule functions
(`forward_backward_pipelining_without_interleaving` / `_with_interleaving`) on
`MegatronModule` stages; torch.distributed.pipelining's `Schedule1F1B`,
`ScheduleZBVZeroBubble` and `ScheduleDualPipeV`; and ours (zb1p, dualpipe, dualpipev) on
our `PipelineExecutor` with dW deferral on. {pp} forked CPU+gloo ranks, {m} micro-batches;
every stage is made of sleep layers whose F, dX and dW sleep separately (two autograd
nodes per layer); a rank's share of the model is {layers} layers of {layer_ms:g} ms per
pass (F=B=W={share:g} ms per rank share); schedules with two stages per rank run half as
many layers per stage. {launches} launches; in each, every rank builds every schedule,
runs {warmup} warm-up round(s), then {steps} measured rounds; a round runs each schedule
once behind a barrier, starting at a different schedule each round. Why sleeps, and how
each peer runs: [benchmark-method.md](benchmark-method.md).{quick_note}

- step: first start to last end over the ranks, median over all measured steps;
  `vs {base}`: median over rounds of the step over {base}'s step in the same round.
- bubble per rank: 1 - busy / step, busy = the time the rank spent inside its sleeps
  (median over steps); `bubble vs base`: mean bubble over the ranks over {base}'s.
- sim.: the simulator on the same schedule (ours: the one the executor ran; Megatron's:
  our IR's 1f1b / interleaved-1f1b as a model of its order; torch's: the imported
  schedule as torch runs it), same costs, plus what this machine adds, measured first in
  a launch of its own: {latency} ms per hop and {overhead} ms on every F, B and W.
- peak act.: the most live (stage, micro-batch) activations on each rank, in units of
  that schedule's stage (half a 1F1B stage for V shapes and interleaving); measured by the
  executor (`StepResult.peak_activations`) for ours, simulated for all; "max in 1F1B
  stages" converts the simulated peak. params: parameters per rank over an even 1/PP
  share (DualPipe holds two copies of every stage; its step includes the gradient swap
  between the copies).

Load average before the run: {load_before}; after: {load_after}. The measured section
took {elapsed:.0f} s."""


def _figure_pair(ctx: BenchContext, run: Any) -> str:
    """Write ours-measured and ours-simulated timelines as PNGs; their markdown."""
    from megatron_dualpipe.planner.export import to_png

    from .measured_report import replayed_ms

    if ctx.out_dir is None or run.timeline is None:
        return ""
    name = run.config.timeline
    measured = ctx.out_dir / f"bench_measured_{name}.png"
    simulated = ctx.out_dir / f"bench_measured_{name}_sim.png"
    to_png(run.timeline, str(measured), title=f"{name}, measured", unit="ms")
    to_png(run.timeline_simulated, str(simulated), title=f"{name}, simulated", unit="ms")
    ctx.progress(f"  wrote {measured}\n  wrote {simulated}")
    replay = replayed_ms(run.timeline)
    fitted = run.timeline.cost
    between = run.timeline.makespan - replay
    p = run.timeline.schedule.placement
    stage_ms = run.config.share_ms * p.num_ranks / p.num_model_stages
    return (
        f"**Timeline of {name}: measured (left; one extra step recorded at the end of the "
        f"last launch) and simulated (right), in ms.** The measured step is "
        f"{run.timeline.makespan:.0f} ms against {run.timeline_simulated.makespan:.0f} ms "
        f"simulated. Its actions took on average F {fitted.f:.1f}, B {fitted.b:.1f}, "
        f"W {fitted.w:.1f}"
        + (f", FB {fitted.fb:.1f}" if fitted.fb is not None else "")
        + f" ms (nominal: F=B=W={stage_ms:g} ms per stage, FB = F + a full backward = "
        f"{3 * stage_ms:g} ms); replaying the same order with those durations and free messages "
        f"gives {replay:.0f} ms, so about {between:.0f} ms of the step is spent between "
        "actions (messages, wake-ups, the runtime itself) rather than in them.\n\n"
        f"| measured | simulated |\n|:---:|:---:|\n"
        f"| [![{name} measured]({measured.name})]({measured.name}) "
        f"| [![{name} simulated]({simulated.name})]({simulated.name}) |"
    )


def measured_section(ctx: BenchContext) -> Section:
    """Measure Megatron's, torch's and our schedules in one interleaved run."""
    from . import measured
    from .measured_report import (
        comparison_table,
        headline,
        measured_table,
        memory_table,
        not_ahead,
    )
    from .profiles import PROFILES
    from .simulated import simulate_cell

    full = measured.MeasuredConfig()
    config = measured.QUICK if ctx.quick else full
    ctx.progress(
        f"  {config.launches} launch(es) of {config.pp} ranks x "
        f"({config.warmup} warm-up + {config.steps} measured) rounds of "
        f"{len(config.schedules)} schedules (load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})"
    )
    run = measured.measure(config, verbose=True)
    main_table, compare, memory = measured_table(run), comparison_table(run), memory_table(run)
    ctx.progress("\n" + main_table + "\n\n" + compare + "\n\n" + memory + "\n")
    overlap = next(p for p in PROFILES if p.key == "moe-overlap")
    overlap_rows = {
        r.schedule: r.makespan
        for r in simulate_cell(overlap, config.pp, config.microbatches)
        if r.makespan is not None
    }
    statements = not_ahead(run, overlap_rows)
    quick_note = (
        f"\n\nThis is the `--quick` configuration ({config.launches} launches x "
        f"{config.steps} measured rounds, so that the whole quick run takes about two "
        f"minutes on this machine); the full run measures {full.launches} launches x "
        f"{full.steps} rounds."
        if ctx.quick
        else ""
    )
    intro = _MEASURED_INTRO.format(
        chunks=2,
        pp=config.pp,
        m=config.microbatches,
        layers=config.layers_per_share,
        layer_ms=1000 * config.layer_s(),
        share=config.share_ms,
        launches=config.launches,
        warmup=config.warmup,
        steps=config.steps,
        quick_note=quick_note,
        base=run.results[0].schedule,
        latency=(
            f"{run.calibration.latency_ms:.3f} (gloo ping-pong)"
            if run.calibration
            else f"{config.latency_ms:g}"
        ),
        overhead=f"{run.calibration.overhead_ms:.3f}" if run.calibration else "0",
        load_before=", ".join(f"{x:.1f}" for x in run.load_before),
        load_after=", ".join(f"{x:.1f}" for x in run.load_after),
        elapsed=run.elapsed_s,
    )
    parts = [
        intro,
        main_table,
        "**Ours against each peer** (step-time ratio: median over rounds of the paired "
        "ratio, per-round range in brackets; below 1: ours is faster)",
        compare,
        "**Memory and time per rank** (`ran`: the function or class that ran the step)",
        memory,
    ]
    figure = _figure_pair(ctx, run)
    if figure:
        parts.append(figure)
    parts += ["### Where we are not ahead, and why", "\n".join(statements)]
    data = {
        "config": asdict(config),
        "elapsed_s": run.elapsed_s,
        "calibration": None if run.calibration is None else asdict(run.calibration),
        "load_before": run.load_before,
        "load_after": run.load_after,
        "headline": headline(run),
        "rounds": run.rounds,
        "results": [
            {**asdict(r), "vs_simulated": r.vs_simulated, "mean_bubble": r.mean_bubble}
            for r in run.results
        ],
        "timeline_ms": None if run.timeline is None else run.timeline.makespan,
        "timeline_simulated_ms": (
            None if run.timeline_simulated is None else run.timeline_simulated.makespan
        ),
    }
    return Section(
        "measured",
        "Measured: Megatron-Core, torch.distributed.pipelining and ours",
        "\n\n".join(parts),
        data,
    )


#: Section key -> builder, in run order.
SECTIONS: dict[str, Callable[[BenchContext], Section]] = {
    "simulated": simulated_section,
    "measured": measured_section,
    "peers": peers_section,
}

#: Sections ``--quick`` leaves out (unless named with ``--only``), and why.
QUICK_SKIPS: dict[str, str] = {
    "peers": "the measured section runs torch's schedules too",
}


#: Where the GPU checks stand (``scripts/gpu_check.py``): replace with its dated figures and
#: the GPU's name once it has run on one.
GPU_CHECKS = (
    "## GPU checks\n\n"
    "`python scripts/gpu_check.py` (one GPU: Transformer Engine's deferred dW through our "
    "deferral in DualPipe's order, bf16 and FP8; FP8 really on in the F&B overlap path; "
    "per-layer F, B (dX), W (dW) times and memory of a dense and a MoE layer at hidden 4096, "
    "sequence 4096, as `simulate --cost` arguments) has not run: no GPU was lent to this work. "
    "`python scripts/gpu_check.py --dry-run` lists its checks and why any cannot run on the "
    "machine at hand."
)


#: The section ``bench/deepseek_h800.py`` writes from DeepSeek's profile (a trace this
#: repository cannot hold): the suite keeps it when it rewrites ``BENCHMARKS.md``.
DEEPSEEK_TITLE = "On DeepSeek's H800 costs"


def _sections(doc: str) -> list[tuple[str, str]]:
    """``doc`` cut at its ``## `` headings: (heading or "" for the head, text) pairs."""
    out: list[tuple[str, str]] = [("", "")]
    for line in doc.splitlines(keepends=True):
        if line.startswith("## "):
            out.append((line[3:].strip(), ""))
        out[-1] = (out[-1][0], out[-1][1] + line)
    return out


def replace_section(doc: str, title: str, body: str) -> str:
    """``doc`` with section ``## title`` holding ``body``: in its place, or, where ``doc``
    has none, before the GPU checks (at the end without them)."""
    text = f"## {title}\n\n{body.strip()}\n\n"
    parts = _sections(doc)
    titles = [t for t, _ in parts]
    if title in titles:
        parts[titles.index(title)] = (title, text)
    else:
        at = titles.index("GPU checks") if "GPU checks" in titles else len(parts)
        parts.insert(at, (title, text))
    return "".join(t for _, t in parts).rstrip("\n") + "\n"


def _document(sections: list[Section], quick: bool, elapsed: float, kept: str | None = None) -> str:
    """``BENCHMARKS.md``; ``kept``: the earlier document, whose DeepSeek section stays."""
    command = "python -m bench" + (" --quick" if quick else "")
    head = [
        "# Benchmarks",
        f"Generated by `{command} --out DIR` (or `python bench/run_all.py`) in "
        f"{elapsed:.0f} s. Numbers below are regenerated, not edited by hand.",
    ]
    body = [f"## {s.title}\n\n{s.markdown}" for s in sections]
    doc = "\n\n".join([*head, *body, GPU_CHECKS]) + "\n"
    earlier = dict(_sections(kept or ""))
    if DEEPSEEK_TITLE in earlier:
        text = earlier[DEEPSEEK_TITLE].split("\n", 1)[1]
        doc = replace_section(doc, DEEPSEEK_TITLE, text)
    return doc


def run(
    *,
    quick: bool = False,
    json_path: Path | None = None,
    out_dir: Path | None = None,
    sections: tuple[str, ...] | None = None,
    progress: Progress = print,
) -> list[Section]:
    """Run ``sections`` (default: all, in :data:`SECTIONS` order), printing progress and
    tables through ``progress``. With ``out_dir``: write the figures and
    ``BENCHMARKS.md`` there; with ``json_path``: write every section's data."""
    if sections is None:
        keys = [k for k in SECTIONS if not (quick and k in QUICK_SKIPS)]
        for key in (k for k in SECTIONS if k not in keys):
            progress(f"== {key}: left out of --quick ({QUICK_SKIPS[key]}) ==")
    else:
        keys = list(sections)
    unknown = [k for k in keys if k not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown bench section(s) {unknown}: choose from {list(SECTIONS)}")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    ctx = BenchContext(quick, out_dir, progress)
    start = time.perf_counter()
    done: list[Section] = []
    for key in keys:
        t0 = time.perf_counter()
        progress(f"== {key} ==")
        done.append(SECTIONS[key](ctx))
        progress(f"== {key}: {time.perf_counter() - t0:.1f} s ==")
    elapsed = time.perf_counter() - start
    if out_dir is not None:
        doc = out_dir / "BENCHMARKS.md"
        kept = doc.read_text(encoding="utf-8") if doc.exists() else None
        doc.write_text(_document(done, quick, elapsed, kept), encoding="utf-8")
        progress(f"wrote {doc}")
    if json_path is not None:
        payload = {
            "quick": quick,
            "elapsed_s": elapsed,
            "sections": {s.key: s.data for s in done},
        }
        json_path.write_text(json.dumps(payload, indent=1), encoding="utf-8")
        progress(f"wrote {json_path}")
    progress(f"bench finished in {elapsed:.1f} s")
    return done
