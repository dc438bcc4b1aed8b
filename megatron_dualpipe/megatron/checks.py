"""Configuration checks for our schedules, run before any process-group or model work.

Each failure is one :class:`DualPipeConfigError` sentence saying what is wrong and what to
change.
"""

from __future__ import annotations

from typing import Any

from ..schedules.generators import generate
from ..schedules.ir import ScheduleError

__all__ = [
    "check_model",
    "OUR_SCHEDULES",
    "MEGATRON_SCHEDULES",
    "DualPipeConfigError",
    "check_run",
    "check_layers",
]

#: Schedules this package runs with its own runtime.
OUR_SCHEDULES = ("zb1p", "dualpipe", "dualpipev")
#: Schedules that select Megatron-Core's own forward-backward functions.
MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")


class DualPipeConfigError(ValueError):
    """A configuration our schedules cannot run; the message says what to change."""


def stages_per_rank(schedule: str) -> int:
    """Model chunks each pipeline rank holds under ``schedule``."""
    return 2 if schedule in ("dualpipe", "dualpipev") else 1


def check_layers(schedule: str, pipeline_size: int, num_layers: int) -> None:
    """The layers must split evenly into the schedule's model stages."""
    model_stages = {"dualpipe": pipeline_size, "dualpipev": 2 * pipeline_size}.get(
        schedule, pipeline_size
    )
    if num_layers % model_stages:
        raise DualPipeConfigError(
            f"{schedule} cuts the model into {model_stages} stages of equal size, but "
            f"--num-layers {num_layers} is not divisible by {model_stages}: use a multiple "
            f"of {model_stages}"
        )


def check_run(
    schedule: str,
    *,
    pipeline_size: int,
    num_microbatches: int,
    config: Any = None,
    virtual_pipeline_size: int | None = None,
    context_parallel_size: int = 1,
) -> None:
    """Refuse unsupported combinations for one of :data:`OUR_SCHEDULES`.

    ``config`` is a Megatron TransformerConfig (or anything with its attribute names);
    checked: layers divisible into stages, no MTP. (Tied embeddings are a property of the
    model: :func:`check_model`.)
    """
    if schedule not in OUR_SCHEDULES:
        known = ", ".join((*MEGATRON_SCHEDULES, *OUR_SCHEDULES))
        raise DualPipeConfigError(f"unknown pipeline schedule {schedule!r}: choose one of {known}")
    if pipeline_size < 2:
        raise DualPipeConfigError(
            f"{schedule} needs --pipeline-model-parallel-size >= 2, got {pipeline_size}"
        )
    if virtual_pipeline_size is not None and virtual_pipeline_size > 1:
        raise DualPipeConfigError(
            f"{schedule} places its own model chunks: unset "
            "--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size"
        )
    if context_parallel_size > 1:
        raise DualPipeConfigError(
            f"{schedule} does not support context parallelism yet: set --context-parallel-size 1"
        )
    try:
        generate(schedule, pipeline_size, num_microbatches)
    except ScheduleError as err:
        raise DualPipeConfigError(str(err)) from None
    if config is None:
        return
    check_layers(schedule, pipeline_size, config.num_layers)
    if getattr(config, "mtp_num_layers", None):
        raise DualPipeConfigError(
            f"{schedule} does not support multi-token prediction yet: unset --mtp-num-layers"
        )


def check_model(schedule: str, model_chunks: Any) -> None:
    """Refuse model features the schedule's placement breaks: DualPipe(V) keep embedding
    and output layer where Megatron's embedding group does not expect them, so tied
    embeddings would be synchronised between the wrong ranks."""
    if schedule not in ("dualpipe", "dualpipev"):
        return
    for chunk in model_chunks:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        if getattr(chunk, "share_embeddings_and_output_weights", False):
            raise DualPipeConfigError(
                f"{schedule} does not support tied embeddings yet: set "
                "--untie-embeddings-and-output-weights (share_embeddings_and_output_weights="
                "False)"
            )
