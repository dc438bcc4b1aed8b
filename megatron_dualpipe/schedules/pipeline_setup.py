"""One run's pipeline, resolved once: :class:`PipelineSetup`.

A run's entry point (Megatron-LM's argument hook, ``get_forward_backward_func``, a dry
run) turns the schedule's name into its registry spec once, with the pipeline size and
the decoder layers of each model stage, and hands this object to the checks, the
placement hook, the model builders and the executor; none of them looks the name up
again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .ir import Placement, ScheduleError
from .registry import ScheduleSpec

__all__ = ["PipelineSetup"]


@dataclass(frozen=True)
class PipelineSetup:
    """A schedule (its registry spec) on ``pipeline_size`` ranks, with the decoder layers
    of each model stage in pipeline order (the stage where data enters first); an empty
    ``stage_layers`` where Megatron's own split of the layers over the ranks still holds
    (read from the model's config by whoever builds or runs it)."""

    spec: ScheduleSpec
    pipeline_size: int
    stage_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        counts, stages = self.stage_layers, self.model_stages
        if counts and (len(counts) != stages or min(counts) < 0):
            raise ScheduleError(
                f"{self.name} at PP={self.pipeline_size} runs {stages} model stages: give "
                f"{stages} per-stage layer counts >= 0, got {list(counts)}"
            )

    @property
    def name(self) -> str:
        """The schedule's name, as ``--pipeline-schedule`` spells it."""
        return self.spec.name

    @property
    def model_stages(self) -> int:
        """How many distinct parts the model is cut into (dualpipe holds each twice)."""
        return self.spec.model_stages(self.pipeline_size)

    def placement(self, num_microbatches: int = 2) -> Placement:
        """Where the stages live (the micro-batches matter only to dualpipe's two
        directions)."""
        stages = self.spec.chunks_per_rank() * self.pipeline_size
        return Placement(self.spec.placement, self.pipeline_size, stages, num_microbatches)

    def with_layers(self, stage_layers: tuple[int, ...]) -> PipelineSetup:
        """This setup with ``stage_layers`` (one count per model stage, checked)."""
        return replace(self, stage_layers=tuple(stage_layers))
