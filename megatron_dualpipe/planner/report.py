"""Plain-text tables of simulation results and of the balance advisor, for the command line."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..schedules.comm_plan import CommPlan
from ..schedules.ir import Schedule
from ..schedules.layout import format_layout
from ..schedules.nccl_rules import NcclReport
from ..schedules.simulate import SimResult
from .advisor import Advice, ParallelSetup
from .bound import StepBound, step_bound
from .memory import MemorySettings, RankMemory
from .nccl_memory import NcclBuffers, nccl_memory

__all__ = [
    "advice_report",
    "bound_line",
    "comparison_table",
    "markdown_table",
    "memory_report",
    "memory_table",
    "nccl_memory_report",
    "nccl_line",
    "rank_table",
    "spread",
    "text_table",
]


def text_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned columns under a header and a rule."""
    cells, widths = _cells(header, rows)
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table with padded columns (readable as plain text too);
    the first column is left-aligned, the others right-aligned."""
    cells, widths = _cells(header, rows)

    def line(row: list[str]) -> str:
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "|".join(
        ":" + "-" * (w + 1) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)
    )
    return "\n".join([line(cells[0]), f"|{rule}|", *map(line, cells[1:])])


def _cells(
    header: Sequence[str], rows: Sequence[Sequence[object]]
) -> tuple[list[list[str]], list[int]]:
    """The header and rows as text, and each column's width."""
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return cells, widths


def bound_line(bound: StepBound) -> str:
    """The step against its compute bound, and the rest of it on the ranks, in one line."""
    exposed = [r.exposed for r in bound.ranks]
    idle = [r.idle for r in bound.ranks]
    imbalance = [r.imbalance for r in bound.ranks]
    return (
        f"compute bound {bound.bound:.2f}: the step is {bound.ratio:.3f}x it "
        f"({100 * bound.efficiency:.1f}% of the bound); per rank, exposed all-to-all "
        f"{spread(exposed)}, idle {spread(idle)}, compute beyond the bound (imbalance) "
        f"{spread(imbalance)}; the split's bound (its busiest rank's compute) "
        f"{bound.split_bound:.2f}: the step is {bound.split_ratio:.3f}x it"
    )


def spread(values: Sequence[float], digits: int = 2) -> str:
    """The mean of ``values`` and their range: ``1.50 (1.00-2.00)``."""
    mean, low, high = statistics.fmean(values), min(values), max(values)
    return f"{mean:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def rank_table(result: SimResult) -> str:
    """Per-rank busy time (its compute and exposed all-to-all), idle time, compute beyond
    the bound (imbalance), bubble ratio and peak live activations, under a line with the
    step against its compute bound."""
    bound = step_bound(result)
    activations = result.schedule.activation_bound
    rows = [
        [
            str(r.rank),
            f"{r.busy:.2f}",
            f"{share.compute:.2f}",
            f"{share.exposed:.2f}",
            f"{r.idle:.2f}",
            f"{round(share.imbalance, 2) + 0.0:+.2f}",
            f"{100 * r.bubble_ratio:.1f}%",
            str(r.peak_activations),
            str(activations[r.rank]) if activations else "-",
        ]
        for r, share in zip(result.ranks, bound.ranks, strict=True)
    ]
    header = ["rank", "busy", "compute", "exposed a2a", "idle", "imbalance", "bubble"]
    header += ["peak act.", "bound"]
    sched = result.schedule
    summary = (
        f"{sched.name}: PP={sched.num_ranks} micro-batches={sched.num_microbatches} "
        f"stages={sched.placement.num_stages} makespan={result.makespan:.2f} "
        f"bubble={100 * result.bubble_ratio:.1f}% params/rank={result.param_factor:g}x"
    )
    return "\n".join([summary, bound_line(bound), text_table(header, rows)])


def _stage_size(result: SimResult) -> float:
    """One stage's size as a fraction of one rank's share of the model."""
    p = result.schedule.placement
    return p.num_ranks / p.num_model_stages


def comparison_table(results: list[SimResult], skipped: dict[str, str]) -> str:
    """One row per schedule, with makespan relative to the first (normally 1F1B)."""
    base = results[0].makespan if results else 0.0
    rows = []
    for r in results:
        idle = [x.bubble_ratio for x in r.ranks]
        rows.append(
            [
                r.schedule.name,
                str(r.schedule.placement.num_stages),
                f"{r.makespan:.2f}",
                f"{r.makespan / base:.3f}" if base else "-",
                f"{step_bound(r).ratio:.3f}",
                f"{100 * r.bubble_ratio:.1f}%",
                f"{100 * min(idle):.1f}-{100 * max(idle):.1f}%",
                str(max(x.peak_activations for x in r.ranks)),
                f"{max(x.peak_activations for x in r.ranks) * _stage_size(r):g}",
                f"{r.param_factor:g}x",
            ]
        )
    header = [
        "schedule",
        "stages",
        "makespan",
        f"vs {results[0].schedule.name}" if results else "ratio",
        "vs bound",
        "bubble",
        "bubble/rank",
        "peak act.",
        "act. memory",
        "params/rank",
    ]
    text = text_table(header, rows)
    text += (
        "\nvs bound: the step over its compute bound (the compute shared evenly over the "
        "ranks, every all-to-all hidden, no wait)"
        "\npeak act.: in stages x micro-batches; act. memory: the same in units of one "
        "1F1B stage's activations of one micro-batch (a model cut into more stages has "
        "smaller ones)"
    )
    for name, reason in skipped.items():
        text += f"\n{name}: not simulated: {reason}"
    return text


def _flop(x: float) -> str:
    """FLOPs with an SI prefix: ``12.05 PFLOP``."""
    for prefix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(x) >= scale:
            return f"{x / scale:.4g} {prefix}FLOP"
    return f"{x:.4g} FLOP"


def _bytes(x: float) -> str:
    """Bytes in binary units: ``156.9 GiB``."""
    for prefix, scale in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.4g} {prefix}B"
    return f"{x:.4g} B"


def advice_report(advice: Advice, model: str, source: str) -> str:
    """The balance advisor's findings: the model and its costs, the splits before and
    after with their simulated step, bubble and memory, and the lines to paste."""
    s = advice.schedule
    p = s.placement
    lines = [
        f"balance advisor: {source} under {s.name}, PP={p.num_ranks}, "
        f"{p.num_model_stages} model stages, {p.num_microbatches} micro-batches",
        f"model: {model}",
        "work per micro-batch on one rank, F / B (dX) / W (dW):",
    ]
    for label, w in advice.parts.items():
        lines.append(f"  {label}: {_flop(w.f)} / {_flop(w.b)} / {_flop(w.w)}")
    cap_from = "" if advice.memory_cap_given else f" (the peak of the {advice.before_label})"
    lines.append(f"memory cap: {_bytes(advice.memory_cap)} per rank{cap_from}")
    lines.append(
        f"searched {advice.splits_considered} splits, {advice.simulated} of them timed by the "
        f"simulator, in {advice.seconds:.1f} s (a local search; no solver)"
    )
    rows = [("before: " + advice.before_label, advice.before)]
    if advice.first_last is not None:
        rows.append(("best first/last", advice.first_last))
    rows.append(("after: proposal", advice.after))
    base = advice.before.makespan
    table = [
        [
            label,
            _flop(c.makespan),
            f"{c.makespan / base:.3f}" if base else "-",
            f"{100 * c.bubble:.1f}%",
            _bytes(c.peak_memory),
            format_layout(list(c.stages)),
        ]
        for label, c in rows
    ]
    header = ["split", "step", "vs before", "bubble", "memory/rank", "layout (pipeline order)"]
    lines += ["", text_table(header, table)]
    if advice.first_last is None:
        lines.append("no split of Megatron's first/last counts fits here within the memory cap")
    lines.append(
        "step: simulated time in FLOPs of one rank (divide by a rank's sustained FLOP/s for "
        "seconds); layout: E embedding, t decoder layer, m MTP layer, L output layer and loss"
    )
    after, before = advice.after, advice.before
    lines.append(
        f"\ngain: step {advice.gain:.3f}x as fast ({after.makespan / before.makespan - 1:+.1%}), "
        f"bubble {100 * before.bubble:.1f}% -> {100 * after.bubble:.1f}%"
    )
    if advice.lines is None:
        lines.append("keep the config's split: nothing searched is faster within the memory cap")
    paste = advice.paste_lines()
    if paste:
        lines.append(f"paste into {source}:")
        lines += [f"  {line}" for line in paste]
    lines += [f"note: {note}" for note in advice.notes]
    return "\n".join(lines)


def nccl_line(
    name: str, plan: CommPlan, size: int | None, streams: str, outcome: NcclReport | Exception
) -> str:
    """One line on a plan run under NCCL's rules (its message sizes and streams): its
    communicators and sends in flight, or the deadlock cycle."""
    sizes = "of unknown size (each send waits for its receive)"
    if size is not None:
        sizes = f"of {size / 2**20:g} MiB"
    how = "lock-step plan, one batch per exchange point"
    where = (
        "every communicator of a rank and its data- and expert-parallel collectives on one "
        "stream"
        if streams == "shared"
        else "a stream per communicator"
    )
    how = f"{how}, messages {sizes}, {where}"
    if isinstance(outcome, Exception):
        return f"NCCL check of {name} ({how}): DEADLOCK: {outcome}"
    most = max(outcome.comms_per_rank, default=0)
    return (
        f"NCCL check of {name} ({how}): ok; {_count(len(outcome.comms), 'communicator')}, "
        f"at most {most} per rank; sends in flight per rank at most "
        f"{', '.join(map(str, outcome.inflight_bound))}"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def memory_table(ranks: Sequence[RankMemory], *, markdown: bool = False) -> str:
    """Per-rank memory in GiB, part by part (:mod:`.memory`), the optimizer states and the
    total with the distributed optimizer and without it."""
    header = [
        "rank",
        "model stages",
        "params",
        "weights",
        "grads",
        "optimizer (dist.)",
        "optimizer (not dist.)",
        "activations",
        "recompute",
        "total (dist.)",
        "total (not dist.)",
    ]
    rows = [
        [
            str(r.rank),
            " ".join(map(str, r.stages)),
            f"{r.params / 1e9:.2f}B",
            _gib(r.weights),
            _gib(r.gradients),
            _gib(r.optimizer_distributed),
            _gib(r.optimizer_not_distributed),
            _gib(r.activations),
            _gib(r.recompute),
            _gib(r.total_with(True)),
            _gib(r.total_with(False)),
        ]
        for r in ranks
    ]
    return (markdown_table if markdown else text_table)(header, rows)


def memory_report(advice: Advice, setup: ParallelSetup, settings: MemorySettings) -> str:
    """The memory of every rank under the config's split (``before``), part by part."""
    ranks = advice.rank_memory(advice.before)
    dp, ep = setup.data_parallel_size, setup.expert_model_parallel_size
    precision = "bf16" if setup.bf16 else "fp32"
    configured = "with" if setup.use_distributed_optimizer else "without"
    worst = max(ranks, key=lambda r: r.total)
    return "\n".join(
        [
            "",
            f"memory per rank under {advice.schedule.name}, the {advice.before_label}, in GiB: "
            f"{precision} weights, fp32 gradients, {setup.optimizer} states (distributed over "
            f"{dp} data-parallel ranks, experts over {max(1, dp // ep)}); {settings.describe()}",
            memory_table(ranks),
            f"most: {_gib(worst.total)} GiB on rank {worst.rank}, {configured} the distributed "
            f"optimizer as configured ({_gib(worst.total_with(True))} GiB with it, "
            f"{_gib(worst.total_with(False))} GiB without)",
            "activations: the schedule's peak of what micro-batches hold from F to B (saved "
            "for the backward) and from B to W (the deferred weight gradients' inputs); "
            "recompute: the largest layer rebuilt inside a B; not counted: temporary buffers "
            "(all-to-all, logits before the softmax), the CUDA context, fragmentation; NCCL's "
            "buffers: the estimate below",
        ]
    )


def nccl_memory_report(schedule: Schedule, buffers: NcclBuffers) -> str:
    """Per rank, the estimated NCCL buffers of each communicator our plan uses
    (:mod:`.nccl_memory`), in MiB, and the most on any rank; labelled an estimate."""
    ranks = nccl_memory(schedule, buffers)
    rows = [
        [
            str(c.rank),
            c.comm,
            _ranks_text(c.members),
            ", ".join(map(str, c.peers)),
            f"{c.bytes / 2**20:.0f}",
        ]
        for comms in ranks
        for c in comms
    ]
    totals = [sum(c.bytes for c in comms) for comms in ranks]
    worst = max(range(len(totals)), key=totals.__getitem__)
    return "\n".join(
        [
            "",
            f"NCCL memory per rank under {schedule.name}, an estimate from NCCL's buffer rules "
            f"(not measured): {buffers.describe()}",
            text_table(["rank", "communicator", "ranks", "peers", "estimate (MiB)"], rows),
            f"most (estimate): {totals[worst] / 2**20:.0f} MiB on rank {worst}; not counted: "
            "Megatron-Core's own groups (tensor-, data-, expert-parallel), NCCL's fixed "
            "structures per communicator; a peer in the same node over NVLink may get more "
            "channels (set NCCL_NCHANNELS_PER_NET_PEER / NCCL_MAX_P2P_NCHANNELS to match)",
        ]
    )


def _ranks_text(ranks: Sequence[int]) -> str:
    """``0-3`` for a run of ranks, else the ranks listed."""
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
