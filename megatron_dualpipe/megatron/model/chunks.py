"""This pipeline rank's model chunks under a schedule: the path Megatron-LM's ``get_model``
builds them by through the placement hook (``megatron_lm.build_model_chunks``).

:func:`build_chunks` makes each chunk with the caller's ``build`` (a GPTModel from
:func:`.layer_specs.gpt_chunk_specs`, or Megatron-LM's model provider) and then, in this
order, before any wrapper: drops the output weight Megatron never uses (MTP with tied
embeddings, :func:`.tied.release_unused_output_weight`), marks the copies of the embedding
that this rank holds in two chunks as one parameter (:func:`.tied.mark_tied_copies`), and,
under a schedule that splits the backward, makes every linear layer defer its weight
gradient to the W actions (:func:`.deferral.enable_weight_grad_deferral`: Megatron's local
linears converted, GPTModel's output layer included; Transformer Engine's linears hooked).
The chunks must then be wrapped in Megatron DDP built from :func:`ddp_config`, and, for
Transformer Engine layers, built from :func:`model_config` (``delay_wgrad_compute``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from ...schedules.registry import ScheduleSpec
from ..grads.deferral import (
    ddp_config_for_deferral,
    enable_weight_grad_deferral,
    with_delay_wgrad_compute,
)
from .tied import mark_tied_copies, release_unused_output_weight

__all__ = ["ChunkEnds", "build_chunks", "ddp_config", "ddp_config_fields", "model_config"]


@dataclass(frozen=True)
class ChunkEnds:
    """Where one local chunk sits: takes the data, ends in the loss, its virtual stage."""

    pre_process: bool
    post_process: bool
    vp_stage: int | None


def model_config(config: TransformerConfig, schedule: ScheduleSpec, transformer_impl: str) -> Any:
    """``config`` for building the chunks: under a schedule that splits the backward with
    Transformer Engine layers, a copy with ``delay_wgrad_compute`` (TE then keeps each dW
    for ``backward_dw()``); else ``config`` itself."""
    if schedule.splits_backward and transformer_impl == "transformer_engine":
        return with_delay_wgrad_compute(config)
    return config


def ddp_config(schedule: ScheduleSpec, **fields: Any) -> DistributedDataParallelConfig:
    """Megatron DDP's config with ``fields``: built for deferral
    (:func:`.deferral.ddp_config_for_deferral`) under a schedule that splits the backward."""
    if schedule.splits_backward:
        return ddp_config_for_deferral(**fields)
    return DistributedDataParallelConfig(**fields)


def ddp_config_fields(config: DistributedDataParallelConfig) -> dict[str, Any]:
    """Every field of an existing DDP config (to rebuild it with :func:`ddp_config`)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def build_chunks(
    build: Callable[[ChunkEnds], nn.Module], ends: Sequence[ChunkEnds], schedule: ScheduleSpec
) -> list[nn.Module]:
    """This rank's chunks, chunk 0 first: ``build(ends)`` for each, then what the module
    docstring lists (to run before any wrapper)."""
    chunks = []
    for chunk_ends in ends:
        chunk = build(chunk_ends)
        release_unused_output_weight(chunk)
        chunk.vp_stage = chunk_ends.vp_stage
        chunks.append(chunk)
    mark_tied_copies(chunks)
    if schedule.splits_backward:
        enable_weight_grad_deferral(chunks)
    return chunks
