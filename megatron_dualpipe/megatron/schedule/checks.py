"""Configuration checks for our schedules, run before any process-group or model work.

Each failure is one :class:`DualPipeConfigError` sentence saying what is wrong and what to
change. The schedules' own facts (chunks, placement, legal micro-batch counts) come from
the schedule registry, looked up by name here once (:func:`pipeline_setup`,
:func:`schedule_spec`); every check takes the resolved spec.
"""

from __future__ import annotations

from ...errors import DualPipeError
from ...schedules.ir import ScheduleError
from ...schedules.layer_split import LayerSplit, stage_layouts
from ...schedules.layout import DECODER
from ...schedules.pipeline_setup import PipelineSetup
from ...schedules.registry import SCHEDULES, ScheduleSpec, spec

__all__ = [
    "DualPipeConfigError",
    "check_run",
    "cuda_device_max_connections",
    "overlap_problem",
    "pipeline_setup",
    "schedule_spec",
    "stage_layers",
]


class DualPipeConfigError(DualPipeError, ValueError):
    """A configuration our schedules cannot run; the message says what to change."""


def schedule_spec(name: str) -> ScheduleSpec:
    """The registry's spec of ``name``; an unknown name is a :class:`DualPipeConfigError`."""
    try:
        return spec(name)
    except ScheduleError as err:
        raise DualPipeConfigError(str(err)) from None


def pipeline_setup(
    schedule: str, pipeline_size: int, layers: int | tuple[int, ...] | None = None, **split: object
) -> PipelineSetup:
    """``schedule`` resolved once on ``pipeline_size`` ranks, with the decoder layers of each
    model stage: ``layers`` as given (one count per model stage), an int split as
    :func:`stage_layers` splits it (``split``: its keywords), or None (Megatron's own split,
    read later from the model's config). Unknown names and wrong counts are a
    :class:`DualPipeConfigError`."""
    found = schedule_spec(schedule)
    if isinstance(layers, int):
        layers = stage_layers(found, pipeline_size, layers, **split)
    try:
        return PipelineSetup(found, pipeline_size, tuple(layers or ()))
    except ScheduleError as err:
        raise DualPipeConfigError(str(err)) from None


def stage_layers(
    schedule: ScheduleSpec,
    pipeline_size: int,
    num_layers: int,
    *,
    first: int | None = None,
    last: int | None = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
    layout: str | None = None,
    mtp_num_layers: int | None = None,
) -> tuple[int, ...]:
    """Decoder layers of each model stage of ``schedule`` at ``pipeline_size`` ranks, in
    pipeline order (the stage where data enters first, the stage ending in the loss last),
    from Megatron's split settings: even, ``first`` / ``last`` (Megatron-LM's
    ``--decoder-first/last-pipeline-num-layers``), the embedding / loss counted as a layer
    (:mod:`~..schedules.layer_split`), or a ``layout`` string with one entry per model stage
    (:mod:`~..schedules.layout`, which reads it as Megatron-Core's parser does, also for the
    balance advisor; the MTP layers in the last stage, with the loss). Raises
    :class:`DualPipeConfigError`, one sentence with the fix."""
    stages = schedule.model_stages(pipeline_size)
    where = f"{schedule.name} at PP={pipeline_size} runs {stages} model stages"
    try:
        split = LayerSplit(num_layers, first, last, account_for_embedding, account_for_loss)
        layouts = stage_layouts(split, stages, layout, mtp_num_layers or 0)
    except ScheduleError as err:
        raise DualPipeConfigError(f"{where}: {err}") from None
    return tuple(stage.count(DECODER) for stage in layouts)


def check_run(
    found: ScheduleSpec,
    *,
    pipeline_size: int,
    num_microbatches: int,
    virtual_pipeline_size: int | None = None,
    context_parallel_size: int = 1,
) -> None:
    """Refuse unsupported combinations for a schedule our runtime runs: too few ranks, a
    virtual pipeline, context parallelism, illegal micro-batch counts. (How the layers split
    into stages: :func:`stage_layers`; the placement's roles check the model's config.)"""
    schedule = found.name
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


def overlap_problem(
    found: ScheduleSpec,
    *,
    expert_parallel: int,
    dispatcher: str,
    half_precision: bool,
    recompute_granularity: str | None = None,
    mtp_num_layers: int | None = None,
    moe: bool = True,
) -> str | None:
    """Why ``overlap_moe_expert_parallel_comm`` cannot run with these settings (Megatron-Core's
    own preconditions, and a schedule with FB pairs), every unmet one in one sentence, or
    None. ``moe``: whether the model has routed experts."""
    pairs = [n for n, s in SCHEDULES.items() if s.places_chunks]
    needs: list[tuple[str, str]] = []  # (what it needs, what to change)
    if not found.places_chunks:
        needs.append((
            f"a schedule with FB pairs to overlap ({' or '.join(pairs)}; {found.name} has none)",
            f"choose {' or '.join(pairs)}",
        ))  # fmt: skip
    if not moe:
        needs.append(("a MoE model", "give the model routed experts (num_experts)"))
    if expert_parallel < 2:
        needs.append((
            "expert parallelism",
            "set the expert-model-parallel size to 2 or more (the data-parallel size, world "
            "size / (TP x PP), a multiple of it)",
        ))  # fmt: skip
    if dispatcher not in ("alltoall", "flex"):
        needs.append((
            f"the alltoall or flex token dispatcher (got {dispatcher!r})",
            "set the token dispatcher to alltoall",
        ))  # fmt: skip
    if not half_precision:
        needs.append(("a bf16 (or fp16) model", "turn bf16 on"))
    if recompute_granularity == "full":
        needs.append((
            "selective or no activation recomputation (got full)",
            "unset recompute_granularity",
        ))  # fmt: skip
    if mtp_num_layers is not None and mtp_num_layers > 1:
        needs.append((f"at most one MTP layer (got {mtp_num_layers})", "set mtp_num_layers to 1"))
    if not needs:
        return None
    return (
        f"needs {_listed([n for n, _ in needs])}, as in Megatron-Core: "
        f"{_listed([f for _, f in needs])}, or turn it off"
    )


def _listed(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def cuda_device_max_connections(
    *,
    tensor_parallel: int,
    context_parallel: int = 1,
    overlap: bool,
    current: str | None,
    more_than_one: bool = False,
) -> tuple[str | None, str | None]:
    """``CUDA_DEVICE_MAX_CONNECTIONS`` by Megatron-LM's rule (``validate_args``,
    ``megatron/training/arguments.py``, core_v0.16.1 to core_v0.19.0): with tensor or context
    parallelism, 1 (one hardware queue keeps TP communication ahead of compute, required
    before Blackwell), except with ``overlap_moe_expert_parallel_comm``, whose MoE
    all-to-all must run beside compute (more queues); without either, no requirement.
    ``more_than_one``: what Megatron asserts is not 1 (FSDP, the UCC pipeline backend) is on:
    nothing is set or said (Megatron-LM's own check speaks).

    Returns (the value to set where ``current`` is unset, else None; a one-sentence warning
    where ``current`` works against the rule, else None)."""
    if more_than_one:
        return None, None
    model_parallel = tensor_parallel > 1 or context_parallel > 1
    if current is None:
        return ("1" if model_parallel and not overlap else None), None
    if overlap and current == "1":
        return None, (
            "CUDA_DEVICE_MAX_CONNECTIONS=1 puts all kernels in one hardware queue, so the MoE "
            "all-to-all of overlap_moe_expert_parallel_comm cannot run beside compute: unset "
            "it (Megatron-LM suggests 32 where tensor parallelism is on too)"
        )
    if model_parallel and not overlap and current != "1":
        return None, (
            f"CUDA_DEVICE_MAX_CONNECTIONS={current} with tensor or context parallelism: "
            "Megatron-LM requires 1 on GPUs before Blackwell (its tensor-parallel "
            "communication overlap relies on one hardware queue): unset it or set 1"
        )
    return None, None
