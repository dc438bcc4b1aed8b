"""``megatron-dualpipe train --config X --dry-run``: every chosen pipeline rank of a config
built for real, at full size, without a cluster and without allocating it.

For each chosen pipeline rank (default: all, at data- and expert-parallel coordinate 0),
this process joins a fake world of the config's size as that rank (torch's fake
process-group backend, as Megatron-LM's ``--fake-process-group`` does: every collective
returns at once, nothing is sent, and Megatron's gloo groups are off as there), sets up
Megatron's ``parallel_state`` as ``train`` does (:func:`.loop.initialize_parallel_state`;
the lock-step plan runs on Megatron's pipeline group), and builds the rank's model chunks on
the meta device with the builders ``train`` uses (:func:`.model.build_chunks_here`, then
:func:`.model.in_precision`): every parameter has its shape and dtype, none has storage.
It reports per rank (:class:`RankReport`):

- the chunks: their stage, model stage and layers by type (dense or MoE decoder layers
  with their global numbers, MTP layers, embedding, output layer);
- the parameters of the built modules, counted and in bytes by dtype, and the memory
  model's (:class:`~...planner.memory.MemoryModel`) beside them: the counts must agree
  exactly (:attr:`RankReport.agrees`), and its other figures (FP8 weight copies,
  gradients, optimizer states, activations) are what the dry run does not build;
- the process groups the rank is a member of and the group creations it takes part in:
  Megatron's ``new_group`` calls, each one entered by every rank of the world (the
  pipeline's among them, which carries the plan: nothing more is made);
- the communication plan's messages (:func:`~...schedules.comm_plan.comm_plan`, what the
  executor issues) by peer and kind, sized from the stage input the forward-backward
  function sends (:func:`..forward_backward.stage_input_spec`).

Last, the model's parameters each counted once (:func:`count_once`): by global parameter
name (:func:`..names.global_named_parameters`: dualpipe's mirrored copies, the MTP block's
copy of the embedding and a tied output layer share a name), expert parameters times the
expert-parallel size, tensor-parallel shards (Megatron's parallel linears and embedding)
times the tensor-parallel size.

Without Transformer Engine the chunks are built from Megatron-Core's local layers (the
same parameters: TE fuses each norm into the following linear layer and the experts into
one grouped GEMM) and without FP8 (its weight copies are not parameters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.utils import unwrap_model
from torch.distributed import distributed_c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from ...planner.advisor import PipelineSetup, stages_for
from ...planner.memory import GIB, MemoryModel, MemorySettings, RankMemory
from ...planner.model_cost import ModelShape
from ...schedules.comm_plan import Issue, comm_plan
from ...schedules.ir import Kind, ScheduleError
from ..compat.cpu_compat import apply_cpu_compat
from ..model.layer_specs import te_available
from ..model.names import global_named_parameters
from ..model.placement import config_chunk_roles
from ..schedule.checks import schedule_spec
from ..schedule.forward_backward import stage_input_spec
from .config import ConfigError, TrainConfig
from .data.tokenizer import build_tokenizer, model_vocab_size
from .loop import initialize_parallel_state
from .model import build_chunks_here, in_precision, transformer_config, transformer_impl

__all__ = [
    "ChunkReport",
    "DryRun",
    "GroupReport",
    "MessageLine",
    "RankReport",
    "count_once",
    "dry_run",
    "dry_run_lines",
    "parse_ranks",
]


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
    """One pipeline rank, built (see the module docstring)."""

    pipeline_rank: int
    global_rank: int
    chunks: tuple[ChunkReport, ...]
    model: RankMemory | None
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

    @property
    def agrees(self) -> bool | None:
        """Whether the memory model counts exactly the built parameters (None: no model)."""
        if self.model is None:
            return None
        return (round(self.model.params), round(self.model.expert_params)) == (
            self.params,
            self.expert_params,
        )


@dataclass(frozen=True)
class DryRun:
    """The reports of the built ranks, the model's parameters counted once, what was built
    in place of the config (``notes``), and the time and host memory it took."""

    cfg: TrainConfig
    ranks: tuple[RankReport, ...]
    unique_params: int
    unique_mtp_params: int
    all_pipeline_ranks: bool
    notes: tuple[str, ...]
    seconds: float
    peak_host_bytes: int


def parse_ranks(text: str | None, pipeline_size: int) -> list[int]:
    """``--ranks`` (comma-separated pipeline ranks) as a sorted list; every rank when None.
    ConfigError in one sentence for anything else."""
    if text is None:
        return list(range(pipeline_size))
    try:
        ranks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        ranks = []
    if not ranks or not all(0 <= r < pipeline_size for r in ranks):
        raise ConfigError(
            f"--ranks {text}: give pipeline ranks between 0 and {pipeline_size - 1}, "
            "separated by commas (e.g. --ranks 0,7)"
        )
    return ranks


def _build_config(cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """``cfg`` as this machine can build it, and what changed: local layers without
    Transformer Engine, no FP8 with them."""
    if transformer_impl(cfg) != "transformer_engine" or te_available():
        return cfg, []
    notes = [
        "Transformer Engine is not installed here: built with Megatron-Core's local layers "
        "(the same parameters: TE fuses each norm into the next linear layer and the experts "
        "into grouped GEMMs)"
    ]
    if cfg.fp8 is not None:
        notes.append(
            f"built without FP8 ({cfg.fp8}): TE's FP8 weight copies are not parameters; the "
            "memory model counts them in the weights"
        )
    return dataclasses.replace(cfg, transformer_impl="local", fp8=None), notes


def _values(cfg: TrainConfig, vocab_size: int) -> dict[str, Any]:
    """The config's keys as the memory model reads them (the embedding's rows as built)."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    values.update(vocab_size=vocab_size, world_size=cfg.launch_world_size)
    return values


def _memory_ranks(cfg: TrainConfig, vocab_size: int, notes: list[str]) -> list[RankMemory]:
    """The memory model's figures of every pipeline rank (empty, with a note, where the
    model does not take the config)."""
    values = _values(cfg, vocab_size)
    found = schedule_spec(cfg.pipeline_schedule)
    if found.chunks is None:
        notes.append(
            f"the memory model takes schedules with a fixed number of stages per rank, not "
            f"{found.name}: its figures are left out"
        )
        return []
    try:
        shape = ModelShape.from_values(values, "config")
        setup = PipelineSetup.from_values(values, "config")
        settings = MemorySettings.from_values(values, "config")
        pp = cfg.pipeline_model_parallel_size
        schedule = found.generate(pp, cfg.num_microbatches)
        stages = stages_for(shape, setup, found.model_stages(pp))
        return MemoryModel.for_setup(shape, setup, schedule, settings).ranks(stages)
    except ScheduleError as err:
        notes.append(f"the memory model does not take this config ({err})")
        return []


@contextlib.contextmanager
def _fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of a fake world of ``world_size`` ranks."""
    if dist.is_initialized():
        raise ConfigError(
            "--dry-run makes its own fake world: run it in a process without a process group"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _world_creations() -> int:
    """Group creations of the whole world this process has entered so far: torch numbers
    each ``new_group`` without local synchronisation from this count, on every rank."""
    return distributed_c10d._world.group_count


def _groups(pipeline: dist.ProcessGroup) -> tuple[GroupReport, ...]:
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


def _chunk_report(chunk: torch.nn.Module, index: int, model_stage: int) -> ChunkReport:
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


def _messages(cfg: TrainConfig, config: Any, rank: int) -> tuple[list[MessageLine], int, Any]:
    """The rank's messages in one step of the plan the executor runs, by (direction, kind,
    peer, stage), each of the stage input's size; the plan's exchange points."""
    spec = stage_input_spec(
        config, cfg.seq_length, cfg.micro_batch_size, cfg.tensor_model_parallel_size
    )
    size = spec.dtype.itemsize
    for dim in spec.shape:
        size *= dim
    found = schedule_spec(cfg.pipeline_schedule)
    schedule = found.generate(cfg.pipeline_model_parallel_size, cfg.num_microbatches)
    plan = comm_plan(schedule, message_bytes=size)
    issues = [step for step in plan.ranks[rank] if isinstance(step, Issue)]
    found_lines: Counter[tuple[str, str, int, int]] = Counter()
    for issue in issues:
        for op in issue.ops:
            what = "activation" if op.key[0] is Kind.RECV_F else "gradient"
            found_lines[(op.kind, what, op.peer, op.key[1])] += 1
    model_stage = schedule.placement.model_stage
    lines = [
        MessageLine(direction, what, peer, stage, model_stage(stage), count, size)
        for (direction, what, peer, stage), count in sorted(found_lines.items())
    ]
    return lines, len(issues), spec


def _rank(
    cfg: TrainConfig,
    build_cfg: TrainConfig,
    pipeline_rank: int,
    vocab_size: int,
    memory: list[RankMemory],
) -> tuple[RankReport, dict[str, tuple[int, int]]]:
    """Build pipeline rank ``pipeline_rank`` (at data- and expert-parallel coordinate 0)
    in a fake world; its report and its parameters by global name (elements, how many
    such shards the model has)."""
    started = time.perf_counter()
    world = cfg.launch_world_size
    global_rank = pipeline_rank * (world // cfg.pipeline_model_parallel_size)
    with _fake_rank(global_rank, world):
        before = _world_creations()
        initialize_parallel_state(cfg, gloo_groups=False)
        try:
            world_creations = _world_creations() - before
            where = (
                parallel_state.get_pipeline_model_parallel_rank(),
                parallel_state.get_data_parallel_rank(),
                parallel_state.get_expert_model_parallel_rank(),
            )
            if where != (pipeline_rank, 0, 0):
                raise ConfigError(
                    f"global rank {global_rank} is at (pipeline, data, expert) {where}, not "
                    f"({pipeline_rank}, 0, 0): Megatron's rank order is not the one assumed"
                )
            pipeline = parallel_state.get_pipeline_model_parallel_group()
            config = transformer_config(build_cfg, on_gpu=False)
            with torch.device("meta"):
                chunks, ends = build_chunks_here(build_cfg, config, vocab_size, initialise=False)
                chunks = in_precision(build_cfg, config, chunks, ends)
            stages = _model_stages(cfg, config, pipeline_rank, len(chunks))
            reports = tuple(
                _chunk_report(c, i, stage)
                for i, (c, stage) in enumerate(zip(chunks, stages, strict=True))
            )
            named = _shards(chunks, cfg)
            if schedule_spec(cfg.pipeline_schedule).runs_ours:
                messages, points, spec = _messages(cfg, config, pipeline_rank)
                shape = (spec.shape, str(spec.dtype).removeprefix("torch."))
            else:
                messages, points, shape = [], 0, ((), "")
            report = RankReport(
                pipeline_rank=pipeline_rank,
                global_rank=global_rank,
                chunks=reports,
                model=memory[pipeline_rank] if memory else None,
                groups=_groups(pipeline),
                world_creations=world_creations,
                messages=tuple(messages),
                message_shape=shape,
                exchange_points=points,
                seconds=time.perf_counter() - started,
            )
        finally:
            parallel_state.destroy_model_parallel()
    return report, named


def _model_stages(cfg: TrainConfig, config: Any, rank: int, chunks: int) -> list[int]:
    """Each local chunk's model stage: our placements' roles, else Megatron's order (chunk
    ``c`` of rank ``r`` is stage ``c * PP + r``)."""
    pp = cfg.pipeline_model_parallel_size
    if schedule_spec(cfg.pipeline_schedule).places_chunks:
        roles = config_chunk_roles(config, cfg.pipeline_schedule, pp, rank)
        return [role.model_stage for role in roles]
    return [chunk * pp + rank for chunk in range(chunks)]


def _shards(chunks: Sequence[torch.nn.Module], cfg: TrainConfig) -> dict[str, tuple[int, int]]:
    """Every parameter of ``chunks`` by global name: (elements, shards the model has of
    it: the expert-parallel size for an expert's, times the tensor-parallel size where
    Megatron's ``tensor_model_parallel`` mark says tensor parallelism splits it)."""
    out = {}
    for chunk in chunks:
        for name, param in global_named_parameters(chunk).items():
            shards = 1
            if not getattr(param, "allreduce", True):
                shards *= cfg.expert_model_parallel_size
            if getattr(param, "tensor_model_parallel", False):
                shards *= cfg.tensor_model_parallel_size
            out[name] = (param.numel(), shards)
    return out


def count_once(named: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """The model's parameters each counted once, and those of the MTP block among them,
    from global names (elements, shards): :func:`_shards` of every pipeline rank."""
    total = sum(n * shards for n, shards in named.values())
    mtp = sum(n * shards for name, (n, shards) in named.items() if name.startswith("mtp."))
    return total, mtp


def dry_run(cfg: TrainConfig, ranks: Sequence[int] | None = None, source: str = "config") -> DryRun:
    """Build ``ranks`` (pipeline ranks; default every one) of ``cfg`` on the meta device in
    a fake world (see the module docstring). Run it in a process with no process group."""
    started = time.perf_counter()
    pp = cfg.pipeline_model_parallel_size
    chosen = list(range(pp)) if ranks is None else sorted(set(ranks))
    if not chosen or not all(0 <= r < pp for r in chosen):
        raise ConfigError(f"dry run: pipeline ranks are 0 to {pp - 1}, got {list(ranks or [])}")
    if not torch.cuda.is_available():
        apply_cpu_compat()
    build_cfg, notes = _build_config(cfg)
    notes.append(
        "Megatron's gloo groups are off (as under Megatron-LM's --fake-process-group); a real "
        "run on megatron-core 0.16 also makes gloo twins of the data-parallel groups"
    )
    vocab_size = model_vocab_size(cfg, build_tokenizer(cfg, source))
    memory = _memory_ranks(cfg, vocab_size, notes)
    reports, named = [], {}
    for rank in chosen:
        report, mine = _rank(cfg, build_cfg, rank, vocab_size, memory)
        reports.append(report)
        named.update(mine)
    total, mtp = count_once(named)
    return DryRun(
        cfg=cfg,
        ranks=tuple(reports),
        unique_params=total,
        unique_mtp_params=mtp,
        all_pipeline_ranks=len(chosen) == pp,
        notes=tuple(notes),
        seconds=time.perf_counter() - started,
        peak_host_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


# -- the printed report -------------------------------------------------------------------


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


def _chunk_line(c: ChunkReport) -> str:
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


def _model_lines(r: RankReport, cfg: TrainConfig) -> list[str]:
    if r.model is None:
        return ["  memory model: not available for this config"]
    m = r.model
    verdict = "agree exactly" if r.agrees else "DIFFER"
    built_bytes = sum(b for c in r.chunks for _, b in c.by_dtype.values())
    fp8 = m.weights - m.params * (2 if cfg.bf16 else 4)
    lines = [
        f"  memory model: {_n(round(m.params))} parameters, experts "
        f"{_n(round(m.expert_params))}: {verdict} with the built modules"
        + ("" if r.agrees else f" (built {_n(r.params)}, experts {_n(r.expert_params)})"),
        f"  memory model beside the build: weights {_b(m.weights)} (built {_b(built_bytes)}"
        + (f", and {_b(fp8)} of TE's two FP8 copies of each linear weight" if fp8 > 0.5 else "")
        + f"), gradients {_b(m.gradients)}, optimizer states {_b(m.optimizer)}, activations "
        f"{_b(m.activations)}, recompute {_b(m.recompute)}: not built by the dry run",
    ]
    return lines


def _rank_lines(r: RankReport, cfg: TrainConfig) -> list[str]:
    lines = [
        f"pipeline rank {r.pipeline_rank} (global rank {r.global_rank}, built in "
        f"{r.seconds:.1f} s): {_n(r.params)} parameters"
    ]
    lines += [_chunk_line(c) for c in r.chunks]
    lines += _model_lines(r, cfg)
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


def dry_run_lines(result: DryRun) -> list[str]:
    """The report, rank by rank; the last line the model's parameters counted once."""
    cfg = result.cfg
    lines = [
        f"dry run of {cfg.pipeline_schedule} at PP={cfg.pipeline_model_parallel_size} "
        f"TP={cfg.tensor_model_parallel_size} EP={cfg.expert_model_parallel_size} "
        f"DP={cfg.data_parallel_size} in a fake world of {cfg.launch_world_size} ranks, "
        f"{cfg.num_microbatches} micro-batches: model chunks on the meta device "
        "(nothing allocated)"
    ]
    lines += [f"note: {n}" for n in result.notes]
    for report in result.ranks:
        lines += _rank_lines(report, cfg)
    agree = [r.agrees for r in result.ranks if r.agrees is not None]
    if agree:
        lines.append(
            f"parameter counts of the memory model and the built modules: "
            f"{sum(agree)} of {len(agree)} ranks agree exactly"
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
