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
It reports per rank (:class:`~..model.built.RankReport`):

- the chunks: their stage, model stage and layers by type (dense or MoE decoder layers
  with their global numbers, MTP layers, embedding, output layer);
- the parameters of the built modules, counted and in bytes by dtype (the entry point
  puts the memory model's beside them: :mod:`~...planner.dry_run_report`);
- the process groups the rank is a member of and the group creations it takes part in:
  Megatron's ``new_group`` calls, each one entered by every rank of the world (the
  pipeline's among them, which carries the plan: nothing more is made);
- the communication plan's messages (:func:`~...schedules.comm_plan.comm_plan`, what the
  executor issues) by peer and kind, sized from the stage input the forward-backward
  function sends (:func:`..forward_backward.stage_input_spec`).

Last, the model's parameters each counted once (:func:`~..model.built.count_once`): by
global parameter name (:func:`..model.names.global_named_parameters`: dualpipe's
mirrored copies, the MTP block's copy of the embedding and a tied output layer share a
name), expert parameters times the expert-parallel size, tensor-parallel shards
(Megatron's parallel linears and embedding) times the tensor-parallel size.

Without Transformer Engine the chunks are built from Megatron-Core's local layers (the
same parameters: TE fuses each norm into the following linear layer and the experts into
one grouped GEMM) and without FP8 (its weight copies are not parameters).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
from megatron.core import parallel_state

from ..compat.cpu_compat import apply_cpu_compat
from ..model.built import (
    BuiltSetup,
    DryRun,
    RankReport,
    fake_rank,
    finished,
    rank_report,
    world_creations,
)
from ..model.layer_specs import te_available
from .config import ConfigError, TrainConfig
from .data.tokenizer import build_tokenizer, model_vocab_size
from .loop import initialize_parallel_state
from .model import build_chunks_here, in_precision, transformer_config, transformer_impl

__all__ = ["dry_run"]


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


def _setup(cfg: TrainConfig) -> BuiltSetup:
    return BuiltSetup(
        schedule=cfg.pipeline_schedule,
        pipeline=cfg.pipeline_model_parallel_size,
        tensor=cfg.tensor_model_parallel_size,
        expert=cfg.expert_model_parallel_size,
        data=cfg.data_parallel_size,
        world_size=cfg.launch_world_size,
        microbatches=cfg.num_microbatches,
        expert_tensor=cfg.tensor_model_parallel_size,  # Megatron's default: no key for it here
        seq_length=cfg.seq_length,
        micro_batch_size=cfg.micro_batch_size,
        bf16=cfg.bf16,
    )


def _rank(
    cfg: TrainConfig, build_cfg: TrainConfig, pipeline_rank: int, vocab_size: int
) -> tuple[RankReport, dict[str, tuple[int, int]]]:
    """Build pipeline rank ``pipeline_rank`` (at data- and expert-parallel coordinate 0)
    in a fake world; its report and its parameters by global name (elements, how many
    such shards the model has)."""
    started = time.perf_counter()
    world = cfg.launch_world_size
    global_rank = pipeline_rank * (world // cfg.pipeline_model_parallel_size)
    with fake_rank(global_rank, world):
        before = world_creations()
        initialize_parallel_state(cfg, gloo_groups=False)
        try:
            creations = world_creations() - before
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
            config = transformer_config(build_cfg, on_gpu=False)
            with torch.device("meta"):
                chunks, ends = build_chunks_here(build_cfg, config, vocab_size, initialise=False)
                chunks = in_precision(build_cfg, config, chunks, ends)
            ranks = (pipeline_rank, global_rank)
            report, named = rank_report(_setup(cfg), config, chunks, ranks, creations, started)
        finally:
            parallel_state.destroy_model_parallel()
    return report, named


def _values(cfg: TrainConfig, vocab_size: int) -> dict[str, Any]:
    """The config's keys as the memory model reads them (the embedding's rows as built)."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    values.update(
        vocab_size=vocab_size,
        world_size=cfg.launch_world_size,
        num_microbatches=cfg.num_microbatches,
    )
    return values


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
    reports, named = [], {}
    for rank in chosen:
        report, mine = _rank(cfg, build_cfg, rank, vocab_size)
        reports.append(report)
        named.update(mine)
    values = _values(cfg, vocab_size)
    return finished(_setup(cfg), values, reports, named, notes, started)
