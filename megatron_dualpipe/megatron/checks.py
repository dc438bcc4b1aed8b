"""Configuration checks for our schedules, run before any process-group or model work.

Each failure is one :class:`DualPipeConfigError` sentence saying what is wrong and what to
change. The schedules' own facts (chunks, placement, legal micro-batch counts) come from
the schedule registry.
"""

from __future__ import annotations

from typing import Any

from ..errors import DualPipeError
from ..schedules.ir import ScheduleError
from ..schedules.registry import SCHEDULES, ScheduleSpec, spec

__all__ = [
    "DualPipeConfigError",
    "check_layers",
    "check_model",
    "check_run",
    "overlap_problem",
    "schedule_spec",
]


class DualPipeConfigError(DualPipeError, ValueError):
    """A configuration our schedules cannot run; the message says what to change."""


def schedule_spec(name: str) -> ScheduleSpec:
    """The registry's spec of ``name``; an unknown name is a :class:`DualPipeConfigError`."""
    try:
        return spec(name)
    except ScheduleError as err:
        raise DualPipeConfigError(str(err)) from None


def check_layers(schedule: str, pipeline_size: int, num_layers: int) -> None:
    """The layers must split evenly into the schedule's model stages."""
    stages = schedule_spec(schedule).model_stages(pipeline_size)
    if num_layers % stages:
        raise DualPipeConfigError(
            f"{schedule} cuts the model into {stages} stages of equal size, but "
            f"--num-layers {num_layers} is not divisible by {stages}: use a multiple of {stages}"
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
    """Refuse unsupported combinations for a schedule our runtime runs.

    ``config`` is a Megatron TransformerConfig (or anything with its attribute names);
    checked: layers divisible into stages, no MTP. (Tied embeddings are a property of the
    model: :func:`check_model`.)
    """
    found = schedule_spec(schedule)
    if not found.runs_ours:
        ours = ", ".join(n for n, s in SCHEDULES.items() if s.runs_ours)
        raise DualPipeConfigError(
            f"{schedule} is Megatron-Core's own schedule, not run by megatron-dualpipe: use "
            f"Megatron's get_forward_backward_func, or one of {ours}"
        )
    if pipeline_size < found.min_ranks:
        raise DualPipeConfigError(
            f"{schedule} needs --pipeline-model-parallel-size >= {found.min_ranks}, got "
            f"{pipeline_size}"
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
    problem = found.problem(pipeline_size, num_microbatches)
    if problem is not None:
        raise DualPipeConfigError(problem)
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
    if not schedule_spec(schedule).places_chunks:
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


def overlap_problem(
    schedule: str,
    *,
    expert_parallel: int,
    dispatcher: str,
    half_precision: bool,
    recompute_granularity: str | None = None,
    mtp_num_layers: int | None = None,
) -> str | None:
    """Why ``overlap_moe_expert_parallel_comm`` cannot run with these settings (Megatron-Core's
    own preconditions, and a schedule with FB pairs), in one sentence, or None."""
    pairs = [n for n, s in SCHEDULES.items() if s.places_chunks]
    if schedule not in pairs:
        return (
            f"overlaps the forward and backward of FB pairs, which {' and '.join(pairs)} run; "
            f"{schedule} has none: choose one of them or turn it off"
        )
    if expert_parallel < 2:
        return "needs expert parallelism: set the expert-model-parallel size to 2 or more"
    if dispatcher not in ("alltoall", "flex"):
        return f"needs the alltoall or flex token dispatcher, got {dispatcher!r}"
    if not half_precision:
        return "needs a bf16 (or fp16) model, as in Megatron-Core: turn bf16 on"
    if recompute_granularity == "full":
        return "cannot run with full activation recomputation: unset recompute_granularity"
    if mtp_num_layers is not None and mtp_num_layers > 1:
        return f"runs at most one MTP layer, got mtp_num_layers {mtp_num_layers}"
    return None
