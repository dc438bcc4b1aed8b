"""Megatron-LM's own training scripts with our schedules: ``--pipeline-schedule``.

``patches/megatron-lm-core_v0.16.1.patch`` wires these hooks into Megatron-LM's
``pretrain_gpt.py`` and ``megatron/training``:

- :func:`add_arguments`: the ``extra_args_provider`` part that adds ``--pipeline-schedule``;
- :func:`apply`: right after Megatron validated its arguments, before any process-group
  work: checks the combination (one sentence saying what to change) and calls
  :func:`megatron_dualpipe.install`;
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
from collections.abc import Callable, Sequence
from typing import Any

from .megatron.checks import MEGATRON_SCHEDULES, OUR_SCHEDULES, DualPipeConfigError, check_run

__all__ = [
    "PIPELINE_SCHEDULES",
    "add_arguments",
    "apply",
    "build_model_chunks",
    "full_batch_on_this_rank",
    "losses_on_last_stage",
    "places_model_chunks",
    "prepare_model",
]

#: Every value of ``--pipeline-schedule``.
PIPELINE_SCHEDULES = (*MEGATRON_SCHEDULES, *OUR_SCHEDULES)
#: Schedules whose ranks hold two model chunks that this module places.
_TWO_CHUNK_SCHEDULES = ("dualpipe", "dualpipev")

_HELP = (
    "pipeline-parallel schedule: 1f1b and interleaved-1f1b are Megatron's own (interleaved "
    "needs a virtual pipeline); zb1p (zero-bubble 1F1B), dualpipe (two model copies, data "
    "entering at both ends; even PP) and dualpipev (V-shaped placement, embedding, head and "
    "loss on pipeline rank 0) run megatron-dualpipe's runtime, with every backward split into "
    "dX and a deferred dW. dualpipe and dualpipev need at least 2 x PP micro-batches per step "
    "and untied embeddings. Default: Megatron's own choice."
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
        help=_HELP,
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
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    pp = args.pipeline_model_parallel_size
    if schedule == "1f1b" and vp is not None and vp > 1:
        raise DualPipeConfigError(
            "1f1b runs one model chunk per rank: unset --num-layers-per-virtual-pipeline-stage "
            "/ --virtual-pipeline-model-parallel-size, or choose interleaved-1f1b"
        )
    if schedule == "interleaved-1f1b" and (vp is None or vp < 2 or pp < 2):
        raise DualPipeConfigError(
            "interleaved-1f1b needs pipeline parallelism with two or more model chunks per rank: "
            "set --pipeline-model-parallel-size >= 2 and --num-layers-per-virtual-pipeline-stage"
        )
    if schedule not in OUR_SCHEDULES:
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
    if schedule in _TWO_CHUNK_SCHEDULES:
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


def apply(args: Any, *, exit_on_error: bool = False) -> None:
    """Check ``args.pipeline_schedule`` against the rest of Megatron's (validated) arguments
    and select it with :func:`megatron_dualpipe.install`. No-op without the argument.

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
    from . import install

    install(schedule)


def places_model_chunks(args: Any) -> bool:
    """Whether :func:`build_model_chunks` builds this run's model (dualpipe, dualpipev)."""
    return _schedule(args) in _TWO_CHUNK_SCHEDULES


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


def prepare_model(model: Sequence[Any], args: Any) -> None:
    """After building and wrapping: make dualpipe's two copies of every stage start equal
    (a collective over the pipeline group). No-op for other schedules."""
    if _schedule(args) == "dualpipe":
        from .megatron.mirror import prepare_mirrors

        prepare_mirrors(model)


def full_batch_on_this_rank(args: Any) -> bool:
    """Whether a data-loading rank must receive every field of the batch (tokens and labels)
    over tensor parallelism: under dualpipe and dualpipev the first pipeline rank (and for
    dualpipe the last) holds both an embedding and a loss."""
    return _schedule(args) in _TWO_CHUNK_SCHEDULES


def losses_on_last_stage(losses: list[dict[str, Any]], args: Any) -> list[dict[str, Any]]:
    """Move the per-micro-batch loss reports to the last pipeline stage, where Megatron's
    training loop averages and logs them.

    Under dualpipe and dualpipev the losses are computed on pipeline rank 0 (dualpipe: and on
    the last rank); every pipeline rank calls this (a collective over the pipeline group):
    the last stage gets all reports, the others an empty list. Other schedules: unchanged.
    """
    if _schedule(args) not in _TWO_CHUNK_SCHEDULES:
        return losses
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    mine = [
        {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in report.items()}
        for report in losses
    ]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return []
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return [
        {k: v.to(device) if torch.is_tensor(v) else v for k, v in report.items()}
        for part in gathered
        for report in part
    ]
