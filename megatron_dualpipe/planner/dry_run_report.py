"""A dry run's built ranks beside the memory model, and the printed report.

The dry run (``train --dry-run``) builds each pipeline rank on the meta device and hands
over its report (the adapter's ``megatron.model.built.DryRun``: read here by its fields, the
planner imports nothing of the adapter). :func:`memory_of_ranks` gives the memory model's
figures for the config's values, :func:`agrees` says whether its parameter counts equal the
built modules' exactly, :func:`dry_run_lines` prints the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..schedules.ir import ScheduleError
from ..schedules.registry import spec
from .advisor import ParallelSetup, stages_for
from .memory import GIB, MemoryModel, MemorySettings, RankMemory
from .model_cost import ModelShape

__all__ = ["agrees", "dry_run_lines", "memory_of_ranks"]


def memory_of_ranks(values: Mapping[str, Any], notes: list[str]) -> list[RankMemory]:
    """The memory model's figures of every pipeline rank for a config's ``values`` (its keys,
    ``vocab_size`` the embedding's rows as built, ``world_size`` and ``num_microbatches``
    given); empty, with a note appended to ``notes``, where the model does not take it."""
    found = spec(values["pipeline_schedule"])
    if found.chunks is None:
        notes.append(
            f"the memory model takes schedules with a fixed number of stages per rank, not "
            f"{found.name}: its figures are left out"
        )
        return []
    try:
        shape = ModelShape.from_values(dict(values), "config")
        setup = ParallelSetup.from_values(dict(values), "config")
        settings = MemorySettings.from_values(values, "config")
        pp = values["pipeline_model_parallel_size"]
        schedule = found.generate(pp, values["num_microbatches"])
        stages = stages_for(shape, setup, found.model_stages(pp))
        return MemoryModel.for_setup(shape, setup, schedule, settings).ranks(stages)
    except ScheduleError as err:
        notes.append(f"the memory model does not take this config ({err})")
        return []


def agrees(report: Any, memory: Sequence[RankMemory]) -> bool | None:
    """Whether the memory model counts exactly the parameters (and expert parameters) built
    on ``report``'s pipeline rank; None where ``memory`` is empty (no model)."""
    if not memory:
        return None
    model = memory[report.pipeline_rank]
    return (round(model.params), round(model.expert_params)) == (
        report.params,
        report.expert_params,
    )


def _n(count: float) -> str:
    """A parameter count: 1,636,622,336 (1.637B)."""
    if count >= 1e9:
        return f"{count:,.0f} ({count / 1e9:.3f}B)"
    if count >= 1e6:
        return f"{count:,.0f} ({count / 1e6:.2f}M)"
    return f"{count:,.0f}"


def _b(nbytes: float) -> str:
    if nbytes >= GIB / 10:
        return f"{nbytes / GIB:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes:,.0f} B"


def _span(layers: tuple[int, ...]) -> str:
    if not layers:
        return ""
    return f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def _chunk_line(c: Any) -> str:
    held = (
        (c.embedding and not c.mtp_layers, "embedding"),
        (c.dense_layers, f"{len(c.dense_layers)} dense decoder ({_span(c.dense_layers)})"),
        (c.moe_layers, f"{len(c.moe_layers)} MoE decoder ({_span(c.moe_layers)})"),
        (c.mtp_layers, f"{c.mtp_layers} MTP (with its embedding copy)"),
        (c.output_layer, "output layer, loss"),
    )
    parts = [text for present, text in held if present]
    dtypes = ", ".join(f"{k} {_n(n)} = {_b(b)}" for k, (n, b) in c.by_dtype.items())
    return (
        f"  chunk {c.chunk} (model stage {c.model_stage}): {' + '.join(parts) or 'nothing'}; "
        f"{_n(c.params)} parameters ({dtypes}; experts {_n(c.expert_params)})"
    )


def _model_lines(r: Any, memory: Sequence[RankMemory], bf16: bool) -> list[str]:
    verdict = agrees(r, memory)
    if verdict is None:
        return ["  memory model: not available for this config"]
    m = memory[r.pipeline_rank]
    built_bytes = sum(b for c in r.chunks for _, b in c.by_dtype.values())
    fp8 = m.weights - m.params * (2 if bf16 else 4)
    return [
        f"  memory model: {_n(round(m.params))} parameters, experts "
        f"{_n(round(m.expert_params))}: {'agree exactly' if verdict else 'DIFFER'} with the "
        "built modules"
        + ("" if verdict else f" (built {_n(r.params)}, experts {_n(r.expert_params)})"),
        f"  memory model beside the build: weights {_b(m.weights)} (built {_b(built_bytes)}"
        + (f", and {_b(fp8)} of TE's two FP8 copies of each linear weight" if fp8 > 0.5 else "")
        + f"), gradients {_b(m.gradients)}, optimizer states {_b(m.optimizer)}, activations "
        f"{_b(m.activations)}, recompute {_b(m.recompute)}: not built by the dry run",
    ]


def _rank_lines(r: Any, memory: Sequence[RankMemory], bf16: bool) -> list[str]:
    lines = [
        f"pipeline rank {r.pipeline_rank} (global rank {r.global_rank}, built in "
        f"{r.seconds:.1f} s): {_n(r.params)} parameters"
    ]
    lines += [_chunk_line(c) for c in r.chunks]
    lines += _model_lines(r, memory, bf16)
    groups = ", ".join(f"{g.name} ({g.size})" for g in r.groups)
    lines.append(f"  process groups it is a member of ({len(r.groups)}): {groups}")
    lines.append(
        f"  group creations it takes part in: {r.world_creations:,} of the whole world "
        "(Megatron's new_group: every rank enters each); the plan runs on Megatron's pipeline "
        "group, none is made for it"
    )
    if not r.messages:
        lines.append("  communication plan: Megatron's own P2P (not planned by this project)")
        return lines
    shape, dtype = r.message_shape
    total = sum(m.count * m.nbytes for m in r.messages)
    count = sum(m.count for m in r.messages)
    lines.append(
        f"  communication plan (lock-step, {r.exchange_points} batches on the pipeline "
        f"group): {count} messages of {_b(r.messages[0].nbytes)} "
        f"({dtype} {'x'.join(map(str, shape))}), {_b(total)} per step"
    )
    for m in r.messages:
        arrow = "to" if m.direction == "send" else "from"
        model = f" (model stage {m.model_stage})" if m.model_stage != m.stage else ""
        lines.append(
            f"    {m.direction} {m.count:>4} x {m.what} of stage {m.stage}'s input{model} "
            f"{arrow} pipeline rank {m.peer}"
        )
    return lines


def dry_run_lines(
    result: Any, memory: Sequence[RankMemory], notes: Sequence[str] = ()
) -> list[str]:
    """The report of ``result`` (a ``DryRun``) beside ``memory`` (:func:`memory_of_ranks` of
    its values, with the ``notes`` that left), rank by rank; the last line the model's
    parameters counted once."""
    s = result.setup
    lines = [
        f"dry run of {s.schedule.name} at PP={s.pipeline} TP={s.tensor} EP={s.expert} DP={s.data} "
        f"in a fake world of {s.world_size} ranks, {s.microbatches} micro-batches: model "
        "chunks on the meta device (nothing allocated)"
    ]
    lines += [f"note: {n}" for n in (*result.notes, *notes)]
    for report in result.ranks:
        lines += _rank_lines(report, memory, s.bf16)
    verdicts = [v for r in result.ranks if (v := agrees(r, memory)) is not None]
    if verdicts:
        lines.append(
            f"parameter counts of the memory model and the built modules: "
            f"{sum(verdicts)} of {len(verdicts)} ranks agree exactly"
        )
    lines.append(
        f"dry run: {len(result.ranks)} ranks in {result.seconds:.1f} s, peak host memory "
        f"{result.peak_host_bytes / GIB:.2f} GiB"
    )
    scope = "" if result.all_pipeline_ranks else " (of the built ranks only)"
    without = result.unique_params - result.unique_mtp_params
    lines.append(
        f"model parameters, each counted once{scope}: {_n(result.unique_params)}; without the "
        f"MTP block ({_n(result.unique_mtp_params)}): {_n(without)}"
    )
    return lines
