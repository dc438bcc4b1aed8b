"""Megatron-LM's own training scripts with our schedules: ``--pipeline-schedule``.

``patches/megatron-lm-core_v0.16.1.patch`` wires these hooks into Megatron-LM's
``pretrain_gpt.py`` and ``megatron/training``:

- :func:`add_arguments`: the ``extra_args_provider`` part that adds ``--pipeline-schedule``;
- :func:`apply`: right after Megatron validated its arguments, before any process-group
  work: checks the combination (one sentence saying what to change);
- :func:`forward_backward_func`: where Megatron-LM's ``train`` and ``evaluate`` ask for
  their forward-backward function, ours for our schedules (one object per run, kept with
  the run's ``args``; nothing is patched);
- :func:`build_model_chunks` / :func:`prepare_model`: ``get_model``'s chunk 0 and chunk 1
  in the schedule's placement (V for dualpipev, mirrored copies for dualpipe);
- :func:`full_batch_on_this_rank`: a rank that holds both an embedding and a loss needs the
  whole batch broadcast over tensor parallelism;
- :func:`losses_on_last_stage`: Megatron reports the loss from the last pipeline stage;
  dualpipev computes it on rank 0 (dualpipe on the first and the last rank).

Importing this module imports neither torch nor megatron; the hooks import them when called.
"""

from __future__ import annotations

import argparse
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .megatron.checks import DualPipeConfigError, check_run, overlap_problem, schedule_spec
from .schedules.registry import SCHEDULES

__all__ = [
    "PIPELINE_SCHEDULES",
    "add_arguments",
    "apply",
    "build_model_chunks",
    "float16_chunks",
    "forward_backward_func",
    "full_batch_on_this_rank",
    "losses_on_last_stage",
    "places_model_chunks",
    "prepare_model",
]

#: Every value of ``--pipeline-schedule``.
PIPELINE_SCHEDULES = tuple(SCHEDULES)
#: The forward-backward object of each Megatron-LM run by ``id(args)``, kept as long as its
#: ``args`` live (a Namespace compares by value, so it cannot key a weak dictionary).
_RUNS: dict[int, tuple[weakref.ref, Callable[..., Any]]] = {}


def _help() -> str:
    """``--pipeline-schedule``'s help, from the registry."""
    parts = [f"{s.name}: {s.summary} ({s.runner.value} runs it)" for s in SCHEDULES.values()]
    return (
        "pipeline-parallel schedule; "
        + "; ".join(parts)
        + ". Default: Megatron's own choice (1f1b, or interleaved-1f1b with a virtual pipeline)."
    )


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--pipeline-schedule`` in its own argument group; returns ``parser`` (Megatron's
    ``extra_args_provider`` contract)."""
    group = parser.add_argument_group(
        "megatron-dualpipe", "bidirectional and zero-bubble pipeline schedules"
    )
    group.add_argument(
        "--pipeline-schedule",
        choices=PIPELINE_SCHEDULES,
        default=None,
        metavar="{" + ",".join(PIPELINE_SCHEDULES) + "}",
        help=_help(),
    )
    return parser


def _schedule(args: Any) -> str | None:
    return getattr(args, "pipeline_schedule", None)


def _num_microbatches(args: Any) -> int:
    """Micro-batches per step, from Megatron's validated arguments."""
    micro = args.micro_batch_size * getattr(args, "data_parallel_size", 1)
    return (args.global_batch_size or micro) // micro


def _check(args: Any) -> None:
    schedule = _schedule(args)
    found = schedule_spec(schedule)
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    pp = args.pipeline_model_parallel_size
    if found.chunks == 1 and vp is not None and vp > 1:
        raise DualPipeConfigError(
            f"{schedule} runs one model chunk per rank: unset "
            "--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size, "
            "or choose interleaved-1f1b"
        )
    if found.chunks is None and (vp is None or vp < 2 or pp < found.min_ranks):
        raise DualPipeConfigError(
            f"{schedule} needs pipeline parallelism with two or more model chunks per rank: "
            "set --pipeline-model-parallel-size >= 2 and --num-layers-per-virtual-pipeline-stage"
        )
    if not found.runs_ours:
        return
    if getattr(args, "rampup_batch_size", None):
        raise DualPipeConfigError(
            f"{schedule} needs the same number of micro-batches every step: unset "
            "--rampup-batch-size"
        )
    check_run(
        schedule,
        pipeline_size=pp,
        num_microbatches=_num_microbatches(args),
        config=args,  # Megatron's args carry num_layers and mtp_num_layers under those names
        virtual_pipeline_size=vp,
        context_parallel_size=getattr(args, "context_parallel_size", 1),
    )
    if found.places_chunks:
        if not getattr(args, "untie_embeddings_and_output_weights", True):
            raise DualPipeConfigError(
                f"{schedule} places the output layer away from Megatron's last stage, so its "
                "weight cannot be tied to the embedding: add --untie-embeddings-and-output-weights"
            )
        if getattr(args, "yaml_cfg", None) is not None:
            raise DualPipeConfigError(
                f"{schedule} builds its model config from command-line arguments: "
                "drop --yaml-cfg and pass the model settings as arguments"
            )
        if getattr(args, "pipeline_model_parallel_layout", None) is not None:
            raise DualPipeConfigError(
                f"{schedule} places the layers itself: unset --pipeline-model-parallel-layout"
            )
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        problem = overlap_problem(
            schedule,
            expert_parallel=getattr(args, "expert_model_parallel_size", 1),
            dispatcher=getattr(args, "moe_token_dispatcher_type", "allgather"),
            half_precision=bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)),
            recompute_granularity=getattr(args, "recompute_granularity", None),
            mtp_num_layers=getattr(args, "mtp_num_layers", None),
        )
        if problem is not None:
            raise DualPipeConfigError(f"--overlap-moe-expert-parallel-comm {problem}")


def apply(args: Any, *, exit_on_error: bool = False) -> None:
    """Check ``args.pipeline_schedule`` against the rest of Megatron's (validated) arguments.
    No-op without the argument.

    Raises :class:`~megatron_dualpipe.megatron.checks.DualPipeConfigError`, one sentence
    saying what to change; with ``exit_on_error``, prints ``error: <sentence>`` and exits 2
    instead (for the launcher: no traceback per rank).
    """
    schedule = _schedule(args)
    if schedule is None:
        return
    try:
        _check(args)
    except DualPipeConfigError as err:
        if not exit_on_error:
            raise
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def forward_backward_func(args: Any, megatrons: Callable[..., Any]) -> Callable[..., Any]:
    """The forward-backward function of this run: ours for a schedule our runtime runs
    (the same object every call with the same ``args``, so its executor is reused),
    else ``megatrons`` (what Megatron's ``get_forward_backward_func()`` returned)."""
    schedule = _schedule(args)
    if schedule is None or not schedule_spec(schedule).runs_ours:
        return megatrons
    key = id(args)
    ref, func = _RUNS.get(key, (None, None))
    if ref is None or ref() is not args:
        from .megatron.forward_backward import DualPipeForwardBackward

        timeout_min = getattr(args, "distributed_timeout_minutes", None)
        options = {"timeout_s": 60.0 * timeout_min} if timeout_min else {}
        func = DualPipeForwardBackward(schedule, **options)
        _RUNS[key] = (weakref.ref(args, lambda _: _RUNS.pop(key, None)), func)
    return func


def places_model_chunks(args: Any) -> bool:
    """Whether :func:`build_model_chunks` builds this run's model (dualpipe, dualpipev)."""
    schedule = _schedule(args)
    return schedule is not None and schedule_spec(schedule).places_chunks


def build_model_chunks(
    model_provider: Callable[..., Any],
    args: Any,
    config_from_args: Callable[[Any], Any],
    *,
    pp_rank: int,
    config: Any = None,
    **provider_kwargs: Any,
) -> list[Any]:
    """This pipeline rank's model chunks, chunk 0 first, in the schedule's placement.

    Calls ``model_provider(pre_process=, post_process=, vp_stage=, config=, **provider_kwargs)``
    once per chunk with the chunk's own ends, and a TransformerConfig whose
    ``pipeline_model_parallel_layout`` is our
    :class:`~megatron_dualpipe.megatron.placement.StagePlacementLayout`, so that Megatron's
    layer builders give each chunk its global layers (and parameter names). The config is
    ``config_from_args(args)`` (Megatron's ``core_transformer_config_from_args``), or
    ``config`` when given, which must already carry such a layout.
    """
    from .megatron.placement import StagePlacementLayout, chunk_roles

    schedule = _schedule(args)
    pp = args.pipeline_model_parallel_size
    if config is None:
        layout = StagePlacementLayout(schedule, pp, args.num_layers)
        with_layout = argparse.Namespace(**vars(args))
        with_layout.pipeline_model_parallel_layout = layout
        config = config_from_args(with_layout)
    elif not isinstance(config.pipeline_model_parallel_layout, StagePlacementLayout):
        raise DualPipeConfigError(
            f"{schedule} needs the model config's pipeline_model_parallel_layout to be "
            f"StagePlacementLayout({schedule!r}, {pp}, num_layers)"
        )
    chunks = []
    for role in chunk_roles(schedule, pp, pp_rank, args.num_layers):
        chunk = model_provider(
            pre_process=role.pre_process,
            post_process=role.post_process,
            vp_stage=role.chunk,
            config=config,
            **provider_kwargs,
        )
        chunk.vp_stage = role.chunk
        chunks.append(chunk)
    return chunks


def float16_chunks(model: Sequence[Any], config: Any, args: Any, *, pp_rank: int) -> list[Any]:
    """``get_model``'s Float16Module wrapping for dualpipe / dualpipev: each chunk converts
    its output to fp32 where our placement puts the loss (Megatron's own wrapper looks for
    it on the last pipeline rank)."""
    from .megatron.placement import chunk_roles
    from .megatron.precision import StageFloat16Module

    roles = chunk_roles(
        _schedule(args), args.pipeline_model_parallel_size, pp_rank, args.num_layers
    )
    return [
        StageFloat16Module(config, chunk, pre_process=r.pre_process, post_process=r.post_process)
        for chunk, r in zip(model, roles, strict=True)
    ]


def prepare_model(model: Sequence[Any], args: Any) -> None:
    """After building and wrapping: make dualpipe's two copies of every stage start equal
    (a collective over the pipeline group). No-op for other schedules."""
    schedule = _schedule(args)
    if schedule is not None and schedule_spec(schedule).placement == "mirror":
        from .megatron.mirror import prepare_mirrors

        prepare_mirrors(model)


def full_batch_on_this_rank(args: Any) -> bool:
    """Whether a data-loading rank must receive every field of the batch (tokens and labels)
    over tensor parallelism: under dualpipe and dualpipev the first pipeline rank (and for
    dualpipe the last) holds both an embedding and a loss."""
    return places_model_chunks(args)


def losses_on_last_stage(losses: list[dict[str, Any]], args: Any) -> list[dict[str, Any]]:
    """Move the per-micro-batch loss reports to the last pipeline stage, where Megatron's
    training loop averages and logs them.

    Under dualpipe and dualpipev the losses are computed on pipeline rank 0 (dualpipe: and on
    the last rank); every pipeline rank calls this (a collective over the pipeline group):
    the last stage gets all reports, the others an empty list. Other schedules: unchanged.
    """
    if not places_model_chunks(args):
        return losses
    from .megatron.loss_reports import reports_to_last_stage

    return reports_to_last_stage(losses)
