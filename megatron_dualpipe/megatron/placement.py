"""Placement hook: which model chunks a pipeline rank builds under each schedule.

Our schedules decide where stages live (``schedules.ir.Placement``); this module turns
that into Megatron terms: for each local chunk its pre/post-process flags and its
*global* layer range, and a :class:`StagePlacementLayout` that Megatron's layer builders
consult (``config.pipeline_model_parallel_layout``), so that layer numbers, and hence
parameter and checkpoint names, match a standard run.

- dualpipev: rank r holds stage r (chunk 0) and stage 2P-1-r (chunk 1) of a model cut into
  2P stages; embedding, output layer and loss are all on rank 0.
- dualpipe: rank r holds model stage r (chunk 0, direction 0) and model stage P-1-r
  (chunk 1, direction 1) of a model cut into P stages: two copies of every stage, whose
  gradients are summed (see :mod:`.mirror`).
- zb1p: the standard one-stage-per-rank split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from ..schedules.ir import Placement
from .checks import check_layers, schedule_spec

__all__ = ["ChunkRole", "StagePlacementLayout", "build_model_chunks", "chunk_roles", "placement_of"]

def placement_of(schedule: str, pipeline_size: int, num_microbatches: int = 2) -> Placement:
    """The IR placement of ``schedule`` (micro-batches matter only for dualpipe's paths)."""
    found = schedule_spec(schedule)
    stages = found.chunks_per_rank() * pipeline_size
    return Placement(found.placement, pipeline_size, stages, num_microbatches)


@dataclass(frozen=True)
class ChunkRole:
    """What one local model chunk is: its stage, model stage, layers and ends."""

    chunk: int
    stage: int
    model_stage: int
    layer_offset: int
    num_layers: int
    pre_process: bool
    post_process: bool


def chunk_roles(schedule: str, pipeline_size: int, rank: int, num_layers: int) -> list[ChunkRole]:
    """The chunks pipeline rank ``rank`` builds under ``schedule``, chunk 0 first."""
    check_layers(schedule, pipeline_size, num_layers)
    p = placement_of(schedule, pipeline_size)
    per_stage = num_layers // p.num_model_stages
    roles = []
    for chunk in range(p.num_chunks):
        stage = p.stage_of(rank, chunk)
        model_stage = p.model_stage(stage)
        roles.append(
            ChunkRole(
                chunk=chunk,
                stage=stage,
                model_stage=model_stage,
                layer_offset=model_stage * per_stage,
                num_layers=per_stage,
                pre_process=model_stage == 0,
                post_process=model_stage == p.num_model_stages - 1,
            )
        )
    return roles


class StagePlacementLayout(PipelineParallelLayerLayout):
    """A layout whose layer counts and offsets come from our placement.

    Megatron's own layout orders stages virtual-stage-major and cannot express a V or a
    mirror; its methods ``get_num_layers_to_build`` and ``get_layer_offset`` are what the
    layer builders ask, so this subclass answers those from :func:`chunk_roles`, with
    ``vp_stage`` meaning the local chunk. The base layout it is built on (embedding first,
    loss last, ``num_layers`` decoders over ``chunks x P`` entries) exists only to pass
    TransformerConfig's validation.
    """

    def __init__(self, schedule: str, pipeline_size: int, num_layers: int):
        entries = schedule_spec(schedule).chunks_per_rank() * pipeline_size
        layers = [["decoder"] * (num_layers // entries) for _ in range(entries)]
        for i in range(num_layers % entries):
            layers[i].append("decoder")
        layers[0].insert(0, "embedding")
        layers[-1].append("loss")
        super().__init__(layers, pipeline_size)
        self.schedule = schedule
        self.num_layers = num_layers
        self._roles = [
            chunk_roles(schedule, pipeline_size, r, num_layers) for r in range(pipeline_size)
        ]

    def _role(self, vp_stage: int | None, pp_rank: int | None) -> ChunkRole:
        from megatron.core import parallel_state

        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        return self._roles[pp_rank][vp_stage or 0]

    def get_num_layers_to_build(
        self,
        layer_type: LayerType = LayerType.decoder,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
    ) -> int:
        if layer_type is not LayerType.decoder:
            return 0
        return self._role(vp_stage, pp_rank).num_layers

    def get_layer_offset(
        self,
        layer_type: LayerType = LayerType.decoder,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
    ) -> int:
        if layer_type is not LayerType.decoder:
            return 0
        return self._role(vp_stage, pp_rank).layer_offset

    def __repr__(self) -> str:
        return f"StagePlacementLayout({self.schedule}, {self.pipeline_model_parallel_size})"


def build_model_chunks(
    model_provider: Callable[..., Any],
    schedule: str,
    *,
    pipeline_size: int,
    rank: int,
    num_layers: int,
) -> list[Any]:
    """Call ``model_provider(pre_process=, post_process=, vp_stage=)`` once per local chunk.

    The provider must build its TransformerConfig with
    ``pipeline_model_parallel_layout=StagePlacementLayout(schedule, pipeline_size,
    num_layers)`` (or receive such a config): that is how Megatron's layer builders learn
    each chunk's global layers.
    """
    return [
        model_provider(
            pre_process=role.pre_process, post_process=role.post_process, vp_stage=role.chunk
        )
        for role in chunk_roles(schedule, pipeline_size, rank, num_layers)
    ]
