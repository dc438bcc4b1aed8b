"""What a dry run reports of one pipeline rank built on the meta device in a fake world:
its chunks (stage, layers, parameters by dtype), the process groups it is a member of, the
group creations it entered and the messages of the communication plan the executor runs.

``train --dry-run`` fills these (with Megatron-LM's builders: :mod:`..lm_dry_run`). The
planner puts the memory model beside them and prints them; nothing here imports it.
"""

from __future__ import annotations

import resource
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.utils import unwrap_model
from torch.distributed import distributed_c10d

from ...schedules.comm_plan import Issue, comm_plan
from ...schedules.ir import Kind
from ...schedules.pipeline_setup import PipelineSetup
from ...schedules.registry import ScheduleSpec
from ..schedule.checks import DualPipeConfigError
from ..schedule.forward_backward import stage_input_spec
from .names import global_named_parameters
from .placement import config_chunk_roles

__all__ = [
    "BuiltSetup",
    "ChunkReport",
    "DryRun",
    "GroupReport",
    "MessageLine",
    "RankReport",
    "chunk_report",
    "count_once",
    "finished",
    "groups",
    "messages",
    "model_stages",
    "parse_ranks",
    "rank_report",
    "shards",
    "world_creations",
]


class BuiltSetup(NamedTuple):
    """The parallel setup a dry run built: the schedule (its spec), sizes
    (``expert_tensor``: the experts' tensor-parallel size), micro-batches, their shape,
    precision."""

    schedule: ScheduleSpec
    pipeline: int
    tensor: int
    expert: int
    data: int
    world_size: int
    microbatches: int
    expert_tensor: int
    seq_length: int
    micro_batch_size: int
    bf16: bool


@dataclass(frozen=True)
class ChunkReport:
    """One built chunk: where it sits, its layers, its parameters by dtype (count, bytes)."""

    chunk: int
    model_stage: int
    dense_layers: tuple[int, ...]
    moe_layers: tuple[int, ...]
    mtp_layers: int
    embedding: bool
    output_layer: bool
    by_dtype: dict[str, tuple[int, int]]
    expert_params: int

    @property
    def params(self) -> int:
        return sum(count for count, _ in self.by_dtype.values())


class GroupReport(NamedTuple):
    """A process group the rank is a member of: Megatron's description, its size."""

    name: str
    size: int


@dataclass(frozen=True)
class MessageLine:
    """Messages of one kind between the rank and one peer in one step: ``direction``
    send or recv, ``what`` activation or gradient, of the input of the schedule's
    ``stage`` (which is ``model_stage`` of the model)."""

    direction: str
    what: str
    peer: int
    stage: int
    model_stage: int
    count: int
    nbytes: int


@dataclass(frozen=True)
class RankReport:
    """One pipeline rank, built: its chunks, groups, group creations and plan messages."""

    pipeline_rank: int
    global_rank: int
    chunks: tuple[ChunkReport, ...]
    groups: tuple[GroupReport, ...]
    world_creations: int
    messages: tuple[MessageLine, ...]
    message_shape: tuple[tuple[int, ...], str]
    exchange_points: int
    seconds: float

    @property
    def params(self) -> int:
        return sum(c.params for c in self.chunks)

    @property
    def expert_params(self) -> int:
        return sum(c.expert_params for c in self.chunks)


@dataclass(frozen=True)
class DryRun:
    """The reports of the built ranks, the model's parameters counted once, what was built
    in place of the config (``notes``), and the time and host memory it took; ``values``: the
    config's keys as the memory model reads them (``vocab_size`` the embedding's rows as
    built, ``world_size`` and ``num_microbatches`` given)."""

    setup: BuiltSetup
    values: dict[str, Any]
    ranks: tuple[RankReport, ...]
    unique_params: int
    unique_mtp_params: int
    all_pipeline_ranks: bool
    notes: tuple[str, ...]
    seconds: float
    peak_host_bytes: int


def finished(
    setup: BuiltSetup,
    values: dict[str, Any],
    reports: Sequence[RankReport],
    named: dict[str, tuple[int, int]],
    notes: Sequence[str],
    started: float,
) -> DryRun:
    """The dry run of the built ``reports`` (``named``: every built rank's :func:`shards`),
    begun at ``started`` (``time.perf_counter()``), with the peak host memory so far."""
    total, mtp = count_once(named)
    return DryRun(
        setup=setup,
        values=values,
        ranks=tuple(reports),
        unique_params=total,
        unique_mtp_params=mtp,
        all_pipeline_ranks=len(reports) == setup.pipeline,
        notes=tuple(notes),
        seconds=time.perf_counter() - started,
        peak_host_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def parse_ranks(text: str | None, pipeline_size: int) -> list[int]:
    """``--ranks`` (comma-separated pipeline ranks) as a sorted list; every rank when None.
    DualPipeConfigError in one sentence for anything else."""
    if text is None:
        return list(range(pipeline_size))
    try:
        ranks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        ranks = []
    if not ranks or not all(0 <= r < pipeline_size for r in ranks):
        raise DualPipeConfigError(
            f"--ranks {text}: give pipeline ranks between 0 and {pipeline_size - 1}, "
            "separated by commas (e.g. --ranks 0,7)"
        )
    return ranks


def world_creations() -> int:
    """Group creations of the whole world this process has entered so far: torch numbers
    each ``new_group`` without local synchronisation from this count, on every rank."""
    return distributed_c10d._world.group_count


def groups(pipeline: dist.ProcessGroup) -> tuple[GroupReport, ...]:
    """The process groups this rank is a member of (the default group first)."""
    out = []
    for group, ranks in distributed_c10d._world.pg_group_ranks.items():
        if not isinstance(group, dist.ProcessGroup):
            continue  # torch's marker for the groups it is not a member of
        if group is pipeline:
            name = "pipeline group (Megatron's; carries the lock-step plan)"
        elif group is dist.group.WORLD:
            name = "world"
        else:
            name = group.group_desc.lower().replace("_", " ")
        out.append(GroupReport(name, len(ranks)))
    return tuple(out)


def _layers(chunk: torch.nn.Module) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Global numbers of the chunk's dense and MoE decoder layers; its MTP layers."""
    inner = unwrap_model(chunk)
    dense, moe = [], []
    for layer in getattr(inner.decoder, "layers", []) if inner.decoder is not None else []:
        (moe if isinstance(layer.mlp, MoELayer) else dense).append(layer.layer_number - 1)
    mtp = getattr(inner, "mtp", None)
    return tuple(dense), tuple(moe), 0 if mtp is None else len(mtp.layers)


def chunk_report(chunk: torch.nn.Module, index: int, model_stage: int) -> ChunkReport:
    """Chunk ``index`` of a rank (model stage ``model_stage``), counted."""
    inner = unwrap_model(chunk)
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    expert = 0
    for param in inner.parameters():
        name = str(param.dtype).removeprefix("torch.")
        counts[name] += param.numel()
        nbytes[name] += param.numel() * param.element_size()
        if not getattr(param, "allreduce", True):  # Megatron's mark of expert parameters
            expert += param.numel()
    dense, moe, mtp = _layers(chunk)
    return ChunkReport(
        chunk=index,
        model_stage=model_stage,
        dense_layers=dense,
        moe_layers=moe,
        mtp_layers=mtp,
        embedding=getattr(inner, "embedding", None) is not None,
        output_layer=getattr(inner, "output_layer", None) is not None,
        by_dtype={k: (counts[k], nbytes[k]) for k in sorted(counts)},
        expert_params=expert,
    )


def model_stages(config: Any, setup: BuiltSetup, rank: int, chunks: int) -> list[int]:
    """Each local chunk's model stage: our placements' roles, else Megatron's order (chunk
    ``c`` of rank ``r`` is stage ``c * PP + r``)."""
    pipeline_size = setup.pipeline
    if setup.schedule.places_chunks:
        roles = config_chunk_roles(config, PipelineSetup(setup.schedule, pipeline_size), rank)
        return [r.model_stage for r in roles]
    return [chunk * pipeline_size + rank for chunk in range(chunks)]


def messages(
    setup: BuiltSetup, config: Any, rank: int
) -> tuple[tuple[MessageLine, ...], int, tuple[tuple[int, ...], str]]:
    """The rank's messages in one step of the plan the executor runs, by (direction, kind,
    peer, stage), each of the stage input's size; the plan's exchange points; the message's
    shape and dtype. Nothing for Megatron's own schedules (its P2P, not our plan)."""
    if not setup.schedule.runs_ours:
        return (), 0, ((), "")
    spec = stage_input_spec(config, setup.seq_length, setup.micro_batch_size, setup.tensor)
    size = spec.dtype.itemsize
    for dim in spec.shape:
        size *= dim
    schedule = setup.schedule.generate(setup.pipeline, setup.microbatches)
    plan = comm_plan(schedule, message_bytes=size)
    issues = [step for step in plan.ranks[rank] if isinstance(step, Issue)]
    found: Counter[tuple[str, str, int, int]] = Counter()
    for issue in issues:
        for op in issue.ops:
            what = "activation" if op.key[0] is Kind.RECV_F else "gradient"
            found[(op.kind, what, op.peer, op.key[1])] += 1
    model_stage = schedule.placement.model_stage
    lines = tuple(
        MessageLine(direction, what, peer, stage, model_stage(stage), count, size)
        for (direction, what, peer, stage), count in sorted(found.items())
    )
    return lines, len(issues), (spec.shape, str(spec.dtype).removeprefix("torch."))


def shards(chunks: Sequence[torch.nn.Module], setup: BuiltSetup) -> dict[str, tuple[int, int]]:
    """Every parameter of ``chunks`` by global name: (elements, shards the model has of
    it: an expert's the expert-parallel size times, where Megatron's
    ``tensor_model_parallel`` mark says it is split, the experts' tensor-parallel size; any
    other the tensor-parallel size where so marked)."""
    out = {}
    for chunk in chunks:
        for name, param in global_named_parameters(chunk).items():
            expert = not getattr(param, "allreduce", True)
            count = setup.expert if expert else 1
            if getattr(param, "tensor_model_parallel", False):
                count *= setup.expert_tensor if expert else setup.tensor
            out[name] = (param.numel(), count)
    return out


def rank_report(
    setup: BuiltSetup,
    config: Any,
    chunks: Sequence[torch.nn.Module],
    ranks: tuple[int, int],
    creations: int,
    started: float,
) -> tuple[RankReport, dict[str, tuple[int, int]]]:
    """The report of the rank at ``ranks`` (pipeline rank, global rank), which built
    ``chunks`` from TransformerConfig ``config`` since ``started`` (``time.perf_counter()``)
    and entered ``creations`` group creations; and its parameters (:func:`shards`)."""
    from megatron.core import parallel_state

    pipeline_rank, global_rank = ranks
    stages = model_stages(config, setup, pipeline_rank, len(chunks))
    lines, points, shape = messages(setup, config, pipeline_rank)
    report = RankReport(
        pipeline_rank=pipeline_rank,
        global_rank=global_rank,
        chunks=tuple(
            chunk_report(c, i, stage)
            for i, (c, stage) in enumerate(zip(chunks, stages, strict=True))
        ),
        groups=groups(parallel_state.get_pipeline_model_parallel_group()),
        world_creations=creations,
        messages=lines,
        message_shape=shape,
        exchange_points=points,
        seconds=time.perf_counter() - started,
    )
    return report, shards(chunks, setup)


def count_once(named: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """The model's parameters each counted once, and those of the MTP block among them,
    from global names (elements, shards): :func:`shards` of every pipeline rank."""
    total = sum(n * count for n, count in named.values())
    mtp = sum(n * count for name, (n, count) in named.items() if name.startswith("mtp."))
    return total, mtp
