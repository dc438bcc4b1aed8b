"""Tables and plain statements of a measured run (:mod:`.measured`): the main table, ours
against every peer, memory and time per rank, the headline ratios, and where ours is not
ahead with the reason the figures give."""

from __future__ import annotations

import statistics

from megatron_dualpipe.planner.report import markdown_table
from megatron_dualpipe.schedules import SimResult, simulate
from megatron_dualpipe.schedules.registry import OUR_SCHEDULES

from .measured import BASELINE, OPTIMISED_PEERS, MeasuredRun

__all__ = [
    "NOISE",
    "OURS",
    "comparison_table",
    "headline",
    "measured_table",
    "memory_table",
    "not_ahead",
    "replayed_ms",
]


def _ranks(values, fmt: str) -> str:
    return " ".join(format(v, fmt) for v in values)


def measured_table(run: MeasuredRun) -> str:
    """The main table: per schedule its measured step (median, spread), ratio to the
    baseline, measured bubble per rank and its ratio, simulated step and measured/sim."""
    config = run.config
    header = [
        "schedule",
        "runs on",
        "step (ms)",
        "min-max",
        f"vs {BASELINE}",
        "bubble/rank (%)",
        "mean bubble",
        "bubble vs base",
        "sim. (ms)",
        "meas./sim.",
        "sim. bubble",
    ]
    rows = [
        [
            r.schedule,
            r.source,
            f"{r.step_ms:.1f}",
            f"{min(r.step_ms_all):.0f}-{max(r.step_ms_all):.0f}",
            f"{r.vs_baseline:.3f}",
            _ranks([100 * b for b in r.bubble], ".0f"),
            f"{100 * r.mean_bubble:.1f}%",
            f"{r.bubble_vs_baseline:.2f}",
            f"{r.simulated_ms:.1f}",
            f"{r.vs_simulated:.3f}",
            f"{100 * statistics.fmean(r.simulated_bubble):.1f}%",
        ]
        for r in run.results
    ]
    n = len(run.results[0].step_ms_all) if run.results else 0
    title = (
        f"**Measured on sleep ops, PP={config.pp}, micro-batches={config.microbatches}, "
        f"F=B=W={config.share_ms:g} ms per rank share"
        f"{f', first and last model stage x{config.end_scale:g}' if config.end_scale != 1 else ''}"
        f"** (median of {n} steps: {config.launches} launches x {config.steps})"
    )
    if run.calibration is not None:
        title += (
            f"; simulated with this machine's P2P latency {run.calibration.latency_ms:.3f} ms "
            f"and per-action overhead {run.calibration.overhead_ms:.3f} ms"
        )
    return title + "\n\n" + markdown_table(header, rows)


def memory_table(run: MeasuredRun) -> str:
    """Per schedule: stages, parameters per rank, peak live activations per rank
    (measured for ours, simulated for all), busy and CPU time per rank."""
    header = [
        "schedule",
        "stages",
        "params",
        "peak act./rank, measured",
        "simulated",
        "max in 1F1B stages",
        "busy/rank (ms)",
        "CPU/rank (ms)",
        "ran",
    ]
    rows = []
    for r in run.results:
        measured = "-" if r.peak_activations is None else _ranks(r.peak_activations, "d")
        rows.append(
            [
                r.schedule,
                str(r.stages),
                f"{r.param_factor:g}x",
                measured,
                _ranks(r.simulated_peak, "d"),
                f"{max(r.simulated_peak) * r.stage_size:g}",
                f"{min(r.busy_ms):.0f}-{max(r.busy_ms):.0f}",
                f"{min(r.cpu_ms):.0f}-{max(r.cpu_ms):.0f}",
                f"`{r.runner.rsplit('.', 1)[-1]}`",
            ]
        )
    return markdown_table(header, rows)


OURS = (*OUR_SCHEDULES, *OPTIMISED_PEERS)
#: Paired ratios within this of 1 are read as "no clear difference": the launch-to-launch
#: spread of a zero-bubble schedule's step on this machine is 3-6%
#: (docs/benchmark-method.md).
NOISE = 0.03


def _fmt_ratio(run: MeasuredRun, name: str, other: str) -> str:
    lo, hi = run.ratio_range(name, other)
    return f"{run.ratio(name, other):.3f} ({lo:.2f}-{hi:.2f})"


def comparison_table(run: MeasuredRun) -> str:
    """Ours against every peer: the median over rounds of the paired step-time ratio
    (per-round range), and measured over simulated."""
    names = [r.schedule for r in run.results]
    ours = [n for n in OURS if n in names]
    peers = [n for n in names if n not in OURS]
    by_name = run.by_name()
    header = ["ours", *[f"/ {p}" for p in peers], "measured / simulated"]
    rows = [
        [n, *[_fmt_ratio(run, n, p) for p in peers], f"{by_name[n].vs_simulated:.3f}"] for n in ours
    ]
    return markdown_table(header, rows)


def headline(run: MeasuredRun) -> dict[str, float]:
    """The figures asked for most: our schedules' step time over Megatron's 1F1B, over
    torch's DualPipeV and ZBV, and measured over simulated."""
    names = {r.schedule for r in run.results}
    out: dict[str, float] = {}
    for ours in OURS:
        if ours not in names:
            continue
        for peer in ("megatron-1f1b", "megatron-interleaved", "torch-dualpipev", "torch-zbv"):
            if peer in names:
                out[f"{ours} / {peer}"] = run.ratio(ours, peer)
        out[f"{ours} measured / simulated"] = run.by_name()[ours].vs_simulated
    return out


def replayed_ms(result: SimResult) -> float:
    """A measured timeline's schedule replayed through the simulator with the measured
    mean duration of each kind of action and free communication: the step this schedule
    would take if nothing happened between actions."""
    schedule = result.schedule
    return simulate(schedule, result.cost).makespan


def not_ahead(run: MeasuredRun, overlap_sim: dict[str, float] | None = None) -> list[str]:
    """Plain statements, as markdown bullets, of where ours is not ahead and why."""
    by_name = run.by_name()
    lines = []
    for ours in OURS:
        if ours not in by_name:
            continue
        mine = by_name[ours]
        for peer in by_name:
            if peer in OURS:
                continue
            ratio = run.ratio(ours, peer)
            if ratio < 1 - NOISE:
                continue
            other = by_name[peer]
            verdict = "slower than" if ratio > 1 + NOISE else "not clearly faster than"
            sim_ratio = mine.simulated_ms / other.simulated_ms
            if sim_ratio > 1 + 1e-9:
                why = (
                    f"the schedule itself: simulated with the same costs, {peer} takes "
                    f"{other.simulated_ms:.0f} ms and {ours} {mine.simulated_ms:.0f} ms"
                )
            elif sim_ratio > 1 - NOISE:
                why = (
                    f"none is expected: the two schedules simulate within "
                    f"{100 * (1 - sim_ratio):.1f}% of each other ({ours} "
                    f"{mine.simulated_ms:.0f} ms, {peer} {other.simulated_ms:.0f} ms), and "
                    f"their measured/simulated are {mine.vs_simulated:.2f} and "
                    f"{other.vs_simulated:.2f}"
                )
            else:
                why = (
                    f"runtime overhead, not the schedule: simulated, {ours} takes "
                    f"{mine.simulated_ms:.0f} ms and {peer} {other.simulated_ms:.0f} ms, but "
                    f"measured/simulated is {mine.vs_simulated:.2f} for {ours} against "
                    f"{other.vs_simulated:.2f} for {peer}"
                )
            lines.append(
                f"- **{ours} is {verdict} {peer}** (step-time ratio {_fmt_ratio(run, ours, peer)}"
                f"): {why}."
            )
    zbv, dpv = by_name.get("torch-zbv"), by_name.get("dualpipev")
    if zbv is not None and dpv is not None:
        text = (
            f"- **Without F&B overlap DualPipeV is not the best schedule, in the simulator "
            f"either.** With these costs torch's ZBV simulates at {zbv.simulated_ms:.0f} ms "
            f"and our DualPipeV at {dpv.simulated_ms:.0f} ms (the simulated grid above shows "
            "the same at every size, with torch's interleaved zero-bubble alongside ZBV), "
            f"and ZBV holds fewer activations ({max(zbv.simulated_peak) * zbv.stage_size:g} "
            f"against {max(dpv.simulated_peak) * dpv.stage_size:g} 1F1B stages' worth)."
        )
        if overlap_sim:
            text += (
                " DualPipeV's gain comes from issuing a forward and a backward together so "
                "that one's communication hides behind the other's compute: with an "
                f"overlapped pair costing 0.7 of its parts, the simulator gives DualPipeV "
                f"{overlap_sim['dualpipev']:.1f} and ZBV {overlap_sim['torch-zbv']:.1f} "
                "rank-share units at this size."
            )
        lines.append(text)
    lines.append(
        "- **Sleep ops cannot show F&B overlap.** An FB action here runs its forward, then "
        "its backward (no overlap hook is registered; torch's DualPipeV runs its "
        "OVERLAP_F_B actions the same way), and on 2 CPU cores there is no second stream "
        "or network to overlap with. So the measured DualPipe(V) rows show the schedules' "
        "bubbles and our runtime's overhead, never the overlap the method is for."
    )
    lines += _memory_statement(run)
    base = by_name.get(BASELINE)
    if base is not None:
        ours_ratios = ", ".join(f"{n} {by_name[n].vs_simulated:.2f}" for n in OURS if n in by_name)
        cpu = ", ".join(
            f"{n} {statistics.fmean(by_name[n].cpu_ms):.0f} ms"
            for n in (BASELINE, *OURS)
            if n in by_name
        )
        cal = run.calibration
        charged = (
            f"the {cal.latency_ms:.3f} ms per message and {cal.overhead_ms:.3f} ms per F, B "
            "and W measured on this machine before the run; what remains is how that "
            "overhead varies over the run"
            if cal is not None
            else f"only {run.config.latency_ms:g} ms per message; the rest is time between "
            "actions"
        )
        lines.append(
            f"- **Runtime overhead.** Measured over simulated step time: {BASELINE} "
            f"{base.vs_simulated:.2f}, {ours_ratios}. The simulator charges {charged} "
            "(each message's wake-up, the runtime's Python, sleep overshoot) on a machine "
            "whose 2 cores the ranks share with each other and with other work. Mean CPU "
            f"time per rank and step: {cpu}. Schedules with two half-size stages per rank "
            "(V shapes, interleaving) run twice the actions and messages, so they pay more "
            "of it."
        )
    return lines


def _memory_statement(run: MeasuredRun) -> list[str]:
    """Where ours costs more memory than the baseline (activations or parameters)."""
    by_name = run.by_name()
    if BASELINE not in by_name:
        return []

    def peak(name: str) -> float:
        r = by_name[name]
        return max(r.simulated_peak) * r.stage_size

    base = peak(BASELINE)
    costlier = [
        f"{n} {peak(n):g} ({by_name[n].param_factor:g}x parameters)"
        for n in OURS
        if n in by_name and (peak(n) > base or by_name[n].param_factor > 1)
    ]
    if not costlier:
        return []
    fastest = min((n for n in OURS if n in by_name), key=lambda n: by_name[n].vs_baseline)
    peers = ", ".join(f"{n} {peak(n):g}" for n in by_name if n not in OURS)
    return [
        f"- **Memory.** Peak live activations on the busiest rank, in 1F1B stages' worth "
        f"(measured by our executor, equal to the simulator's): {', '.join(costlier)} "
        f"against {peers}. Our fastest here, {fastest}, "
        + (
            "holds two copies of every stage: twice the parameters (and their optimizer "
            "state), plus a gradient swap between the copies every step."
            if by_name[fastest].param_factor > 1
            else (
                f"needs {peak(fastest):g} against {BASELINE}'s {base:g}."
                if peak(fastest) > base
                else f"needs no more than {BASELINE} ({base:g})."
            )
        )
    ]
