"""Placement hook: which model chunks a pipeline rank builds under each schedule.

Turns the schedule's placement (``schedules.ir.Placement``) into Megatron's terms: for each
local chunk its pre/post-process flags and its *global* layer range, and a
:class:`StagePlacementLayout` that Megatron's layer builders consult
(``config.pipeline_model_parallel_layout``), so layer, parameter and checkpoint names match
a standard run. Each model stage's layer count is Megatron's own split, read over the model
stages in pipeline order (:func:`~..schedule.checks.stage_layers`). Where each schedule
puts the stages: docs/megatron.md, "Building the model chunks (the placement hook)".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from ...schedules.pipeline_setup import PipelineSetup
from ...schedules.registry import ScheduleSpec
from ..schedule.checks import DualPipeConfigError

__all__ = [
    "ChunkRole",
    "StagePlacementLayout",
    "chunk_roles",
    "config_chunk_roles",
    "embedding_ranks",
]


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


def _need_layers(setup: PipelineSetup) -> tuple[int, ...]:
    """``setup``'s layers per model stage; one sentence where it holds none."""
    if not setup.stage_layers:
        raise DualPipeConfigError(
            f"placing {setup.name}'s chunks needs each model stage's layer count: make the "
            "setup with the model's layers (pipeline_setup(name, pp, num_layers, ...))"
        )
    return setup.stage_layers


def chunk_roles(setup: PipelineSetup, rank: int) -> list[ChunkRole]:
    """The chunks pipeline rank ``rank`` builds under ``setup`` (whose ``stage_layers``
    give each model stage's decoder layers), chunk 0 first."""
    counts = _need_layers(setup)
    p = setup.placement()
    roles = []
    for chunk in range(p.num_chunks):
        stage = p.stage_of(rank, chunk)
        model_stage = p.model_stage(stage)
        roles.append(
            ChunkRole(
                chunk=chunk,
                stage=stage,
                model_stage=model_stage,
                layer_offset=sum(counts[:model_stage]),
                num_layers=counts[model_stage],
                pre_process=model_stage == 0,
                post_process=model_stage == p.num_model_stages - 1,
            )
        )
    return roles


def _stage_contents(counts: Sequence[int], mtp_num_layers: int | None) -> list[list[str]]:
    """Each model stage's layers in Megatron's layout terms: the embedding first, the MTP
    layers and the loss last."""
    stages = [["decoder"] * n for n in counts]
    stages[0].insert(0, "embedding")
    stages[-1] += ["mtp"] * (mtp_num_layers or 0) + ["loss"]
    return stages


class StagePlacementLayout(PipelineParallelLayerLayout):
    """Megatron's layout for a model placed by one of our schedules.

    ``stages`` is Megatron's own :class:`PipelineParallelLayerLayout` of the model stages in
    pipeline order (as if each were a pipeline rank), which Megatron validates; the layout
    itself holds, in ``layout[pp_rank][chunk]``, what each rank's chunk builds (so
    Megatron's readers of ``layout``, such as ``mtp_on_this_rank``, see the truth), and
    answers ``get_num_layers_to_build`` / ``get_layer_offset`` (what the layer builders ask,
    for decoder and MTP layers) with global numbers, ``vp_stage`` meaning the local chunk.
    """

    def __init__(self, setup: PipelineSetup, mtp_num_layers: int | None = None):
        counts = _need_layers(setup)
        pipeline_size, p = setup.pipeline_size, setup.placement()
        contents = _stage_contents(counts, mtp_num_layers)
        self.stages = PipelineParallelLayerLayout(contents, p.num_model_stages)
        # Megatron's 1-D order is chunk-major: entry c * P + r is rank r's chunk c.
        placed = [
            contents[p.model_stage(p.stage_of(rank, chunk))]
            for chunk in range(p.num_chunks)
            for rank in range(pipeline_size)
        ]
        super().__init__(placed, pipeline_size)
        self.setup = setup
        self.mtp_num_layers = mtp_num_layers
        self._placement = p

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: int | None) -> bool:
        """Megatron's validation of the model stages in pipeline order; MTP is never
        standalone (it sits with the loss)."""
        return self.stages.validate_layer_layout(num_layers, mtp_num_layers)

    def roles(self, rank: int) -> list[ChunkRole]:
        """:func:`chunk_roles` of ``rank`` under this layout."""
        return chunk_roles(self.setup, rank)

    def _model_stage(self, vp_stage: int | None, pp_rank: int | None) -> int:
        from megatron.core import parallel_state

        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        return self._placement.model_stage(self._placement.stage_of(pp_rank, vp_stage or 0))

    def get_num_layers_to_build(
        self,
        layer_type: LayerType = LayerType.decoder,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
    ) -> int:
        return self.stages.layout[self._model_stage(vp_stage, pp_rank)][0].count(layer_type)

    def get_layer_offset(
        self,
        layer_type: LayerType = LayerType.decoder,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
    ) -> int:
        stage = self._model_stage(vp_stage, pp_rank)
        return sum(row[0].count(layer_type) for row in self.stages.layout[:stage])

    def __repr__(self) -> str:
        return (
            f"StagePlacementLayout({self.setup.name}, {self.pipeline_model_parallel_size}, "
            f"{list(self.setup.stage_layers)}, mtp={self.mtp_num_layers})"
        )


def config_chunk_roles(config: Any, setup: PipelineSetup, rank: int) -> list[ChunkRole]:
    """:func:`chunk_roles` of ``rank`` for a model built from TransformerConfig ``config``:
    from its :class:`StagePlacementLayout` (required where the schedule places the chunks),
    else from Megatron's own split of the layers over the pipeline ranks."""
    layout = config.pipeline_model_parallel_layout
    schedule, pipeline_size = setup.name, setup.pipeline_size
    if isinstance(layout, StagePlacementLayout):
        built = layout.setup
        if (built.spec, built.pipeline_size) != (setup.spec, pipeline_size):
            raise DualPipeConfigError(
                f"the model was built for {built.name} at PP={built.pipeline_size} but runs "
                f"{schedule} at PP={pipeline_size}: build it with StagePlacementLayout for the "
                "schedule it runs"
            )
        return layout.roles(rank)
    if setup.spec.places_chunks:
        raise DualPipeConfigError(
            f"{schedule} needs the model config's pipeline_model_parallel_layout to be a "
            f"StagePlacementLayout of its setup ({schedule} at PP={pipeline_size} with each "
            "model stage's layers): Megatron's own layouts cannot express its placement"
        )
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if layout is not None:
        counts = [
            layout.get_num_layers_to_build(vp_stage=0, pp_rank=r) for r in range(pipeline_size)
        ]
    else:
        counts = [get_num_layers_to_build(config, pp_rank=r) for r in range(pipeline_size)]
    return chunk_roles(setup.with_layers(tuple(counts)), rank)


def embedding_ranks(schedule: ScheduleSpec | None) -> Callable[[list[int]], list[int]] | None:
    """Megatron's ``get_embedding_ranks`` for ``initialize_model_parallel`` under
    ``schedule``: under dualpipe and dualpipev only the first pipeline rank, so Megatron's
    embedding-group all-reduce is empty (the embedding's copies on one rank are tied locally,
    :mod:`.tied`, and dualpipe's mirrored copies are summed, :mod:`.mirror`); None (Megatron's
    default: first and last rank) otherwise."""
    if schedule is None or not schedule.places_chunks:
        return None
    return _first_rank


def _first_rank(pp_ranks: list[int]) -> list[int]:
    return list(pp_ranks[:1])
