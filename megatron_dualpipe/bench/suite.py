"""The benchmark run: its sections in order, printed as they go, and optionally written as
JSON and as a markdown document with its figures.

A section is a function ``(BenchContext) -> Section`` registered in :data:`SECTIONS`;
``simulated`` (every schedule through the simulator) and ``peers`` (torch's own runtime
measured on sleep ops) exist now; a measured comparison of our runtime and Megatron's
schedules joins as another entry.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SECTIONS", "BenchContext", "Section", "run"]

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
MoE-style overlap; only DualPipe(V) issue such pairs). Columns: T = makespan in units of
one rank share's F; bubble = idle over all ranks' time; vs 1F1B = T over our 1F1B's T;
peak act. = the most live activations on a rank, in units of one 1F1B stage's
activations of one micro-batch (largest over the micro-batch counts); params = parameters
per rank over an even 1/PP share. The lower bound is the least busiest-rank compute time
among the schedules (that work with no idle). `torch-*` rows are
torch.distributed.pipelining's generators imported into our IR and validated."""


def simulated_section(ctx: BenchContext) -> Section:
    """Simulate the grid, print a table per (profile, PP) as it completes, draw a figure
    per profile."""
    from .catalog import PROFILES
    from .plots import plot_bubbles
    from .simulated import simulate_group, simulated_table

    pps = SIM_PPS_QUICK if ctx.quick else SIM_PPS_FULL
    parts, rows = [_SIM_INTRO], []
    for profile in PROFILES:
        profile_rows = []
        for pp in pps:
            counts = [k * pp for k in SIM_MICROBATCH_MULTIPLES]
            group = simulate_group(profile, pp, counts, progress=ctx.progress)
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


#: Section key -> builder, in run order.
SECTIONS: dict[str, Callable[[BenchContext], Section]] = {
    "simulated": simulated_section,
    "peers": peers_section,
}


def _document(sections: list[Section], quick: bool, elapsed: float) -> str:
    command = "megatron-dualpipe bench" + (" --quick" if quick else "")
    head = [
        "# Benchmarks",
        f"Generated by `{command} --out DIR` (or `python bench/run_all.py`) in "
        f"{elapsed:.0f} s. Numbers below are regenerated, not edited by hand.",
    ]
    body = [f"## {s.title}\n\n{s.markdown}" for s in sections]
    return "\n\n".join(head + body) + "\n"


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
    keys = list(SECTIONS) if sections is None else list(sections)
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
        doc.write_text(_document(done, quick, elapsed), encoding="utf-8")
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
