"""``megatron-dualpipe train --dry-run``: every chosen pipeline rank of a
config built the way Megatron-LM's ``pretrain()`` builds it, at full size, without a
cluster and without allocating it.

For each chosen rank this process validates the config's flags as that rank under
Megatron-LM's ``--fake-process-group``, runs ``initialize_megatron`` and builds the rank's
model chunks on the meta device with the builders the patched ``get_model`` calls, then
resets Megatron's global state. The report per rank is :class:`~.model.built.RankReport`,
the whole :class:`~.model.built.DryRun`; what a run would write, load or start is left
out (:data:`_LEFT_OUT`). How and why: docs/memory.md, "Every rank built: the dry run".
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from importlib.util import find_spec
from typing import Any

import torch

from .lm_launch import (
    check_max_connections,
    megatron_lm_run_argv,
    model_parallel_size,
    patched_training,
    set_cuda_device_max_connections,
)
from .model.built import (
    BuiltSetup,
    DryRun,
    RankReport,
    finished,
    parse_ranks,
    rank_report,
    world_creations,
)

__all__ = ["dry_run_with_megatron_lm"]

#: Keys of what a dry run neither writes nor reads, nor starts (it builds a model, it never
#: trains): outputs, the checkpoint to load (kept where its arguments build the model),
#: the persistent checkpoint worker of an asynchronous save, TE's communicators.
_LEFT_OUT = (
    "save", "load", "tensorboard_dir", "wandb_project", "pipeline_timeline", "async_save",
    "tp_comm_overlap",
)  # fmt: skip


def dry_run_with_megatron_lm(
    settings: Mapping[str, Any], source: str, ranks: str | None
) -> DryRun:
    """Build the pipeline ranks ``ranks`` (``--ranks``; default every one) of a config's
    ``settings`` (``lm_launch.read_config``, from ``source``) as Megatron-LM's
    ``pretrain()`` would (docs/memory.md). Run it in a process with no process
    group."""
    from .lm_args import MegatronLMConfigError, megatron_lm_parser

    started = time.perf_counter()
    warning = set_cuda_device_max_connections(settings)  # validate_args asserts it, as in train
    # What the build leaves out and the memory model still counts (FP8's weight copies,
    # sequence parallelism's split activations).
    modelled = {
        key: settings[key]
        for key in ("fp8", "sequence_parallel", "recompute_modules")
        if key in settings
    }
    with patched_training():
        settings, notes = _buildable(settings)
        on_cpu = not torch.cuda.is_available()
        argv, parsed = megatron_lm_run_argv(settings, megatron_lm_parser(), source, on_cpu=on_cpu)
        if on_cpu:
            check_max_connections(parsed, source)
        elif warning is not None:
            logging.getLogger(__name__).warning(warning)
        if getattr(parsed, "use_tp_pp_dp_mapping", False):
            raise MegatronLMConfigError(
                f"{source}: use_tp_pp_dp_mapping: the dry run builds the pipeline ranks of "
                "Megatron's default rank order (tp-cp-ep-dp-pp, the pipeline outermost): "
                "leave use_tp_pp_dp_mapping out of the dry run"
            )
        pp = parsed.pipeline_model_parallel_size
        chosen = parse_ranks(ranks, pp)
        world = int(settings.get("world_size") or model_parallel_size(settings))
        notes.append(
            "Megatron's gloo groups are off (Megatron-LM's --fake-process-group turns them off)"
        )
        reports, named, setup, values = [], {}, None, {}
        for rank in chosen:
            report, mine, setup, values = _rank([*argv, "--fake-process-group"], rank, world, pp)
            reports.append(report)
            named.update(mine)
    assert setup is not None  # parse_ranks gives at least one rank
    return finished(setup, {**settings, **values, **modelled}, reports, named, notes, started)


def _buildable(settings: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``settings`` as this machine builds them on the meta device, and what changed:
    nothing read, written or started, no initial values drawn; local layers without FP8,
    grouped GEMMs or fused permutation where Transformer Engine is not installed; the
    alltoall dispatcher for flex."""
    keep = ("load",) if settings.get("use_checkpoint_args") else ()
    out = {k: v for k, v in settings.items() if k not in _LEFT_OUT or k in keep}
    out["perform_initialization"] = False  # --no-initialization: no values drawn
    notes = []
    te = out.get("transformer_impl", "transformer_engine") != "local"
    if te and not find_spec("transformer_engine"):
        te, out["transformer_impl"] = False, "local"
        notes.append(
            "Transformer Engine is not installed here: built with Megatron-Core's local layers "
            "(the same parameters: TE fuses each norm into the next linear layer and the "
            "experts into grouped GEMMs)"
        )
        if out.pop("fp8", None) is not None:  # Megatron-LM's --fp8-format
            notes.append(
                "built without FP8: TE's FP8 weight copies are not parameters; the memory "
                "model counts them in the weights"
            )
    if out.get("moe_token_dispatcher_type") == "flex":  # Megatron refuses it without a group
        out["moe_token_dispatcher_type"] = "alltoall"
        notes.append(
            "built with the alltoall token dispatcher: Megatron-LM's validate_args refuses "
            "flex over the dry run's fake process group, and a dispatcher holds no parameters"
        )
    kernels = [key for key in ("moe_grouped_gemm", "moe_permute_fusion") if out.get(key)]
    if not te and kernels:  # Megatron-Core's local layers have neither
        for key in kernels:
            out.pop(key)
        notes.append(
            f"built without {' and '.join(kernels)} (CUDA kernels, through Transformer Engine "
            "where it is installed): one MLP per expert holds the same parameters"
        )
        if "moe_grouped_gemm" in kernels:  # what Megatron-Core takes only with grouped GEMMs
            _drop_grouped_gemm_only(out, notes)
    if not te and out.pop("sequence_parallel", None):  # Megatron's local norms refuse it
        notes.append(
            "built without sequence parallelism (Megatron-Core's local norms refuse it): it "
            "splits activations, not parameters; the memory model counts it"
        )
    if te:
        # TE's layers take the meta device from Megatron's --init-model-with-meta-device
        # (_get_extra_te_kwargs); Megatron-Core's own layers of the model (the embedding, the
        # output layer) take the GPU then, as without the dry run.
        out["init_model_with_meta_device"] = True
        notes.append(
            "Transformer Engine's layers built on the meta device "
            "(--init-model-with-meta-device); the embedding and the output layer, "
            "Megatron-Core's own layers, are allocated on this GPU as in a run"
        )
    else:
        # Megatron-Core's local layers make their parameters without a device under
        # --use-cpu-initialization: the build's meta device then.
        out["use_cpu_initialization"] = True
    return out, notes


def _drop_grouped_gemm_only(out: dict[str, Any], notes: list[str]) -> None:
    """What Megatron-Core's ``TransformerConfig`` refuses without ``moe_grouped_gemm``:
    ``moe_act`` among the recomputed modules (the memory model still counts it), and one
    grouped weight or bias for all experts."""
    modules = out.get("recompute_modules")
    if isinstance(modules, list | tuple) and "moe_act" in modules:
        out["recompute_modules"] = [m for m in modules if m != "moe_act"]
        notes.append(
            "built without moe_act among the recomputed modules (Megatron-Core takes it only "
            "with grouped GEMMs; the memory model counts it)"
        )
    single = [k for k in ("moe_single_grouped_weight", "moe_single_grouped_bias") if out.get(k)]
    for key in single:
        out.pop(key)
    if single:
        notes.append(
            f"built without {' and '.join(single)} (grouped GEMMs only): the same parameters, "
            "one tensor per expert"
        )


@contextlib.contextmanager
def _as_rank(argv: list[str], rank: int, world: int) -> Iterator[Any]:
    """Megatron-LM's validated arguments as global rank ``rank`` of ``world`` (its global
    state set, and reset after the block); what Megatron prints and logs below ERROR while
    setting up and building is kept back."""
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from ..megatron_lm import add_arguments
    from .compat.cpu_compat_training import megatron_training_on_cpu

    variables = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}
    saved_env = {k: os.environ.get(k) for k in variables}
    saved_argv = sys.argv
    megatrons = logging.getLogger("megatron")  # its set-up's lines, once per rank built
    saved_level = megatrons.level
    os.environ.update(variables)
    sys.argv = ["pretrain", *argv]
    megatrons.setLevel(logging.ERROR)
    try:
        # validate_args asks the device's architecture with TP or CP > 1
        with megatron_training_on_cpu(), contextlib.redirect_stdout(io.StringIO()):
            args = parse_and_validate_args(
                extra_args_provider=add_arguments,
                args_defaults={"tokenizer_type": "NullTokenizer"},
            )
        yield args
    finally:
        megatrons.setLevel(saved_level)
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        unset_global_variables()


def _rank(
    argv: list[str], pipeline_rank: int, world: int, pp: int
) -> tuple[RankReport, dict[str, tuple[int, int]], BuiltSetup, dict[str, Any]]:
    """Build pipeline rank ``pipeline_rank`` of the fake world; its report, its parameters
    by global name (elements, shards), the setup and the values Megatron-LM derived (the
    padded vocabulary, the micro-batches)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.training.initialize import initialize_megatron

    from .. import megatron_lm as dualpipe_lm
    from .compat.cpu_compat_training import (
        megatron_training_on_cpu,
        skip_compiling_shipped_dataset_helpers,
    )
    from .pretrain_gpt import get_embedding_ranks
    from .schedule.checks import DualPipeConfigError

    started = time.perf_counter()
    global_rank = pipeline_rank * (world // pp)
    with _as_rank(argv, global_rank, world) as args:
        try:
            skip_compiling_shipped_dataset_helpers()
            with megatron_training_on_cpu(), contextlib.redirect_stdout(io.StringIO()):
                initialize_megatron(get_embedding_ranks=get_embedding_ranks)
            creations = world_creations()
            where = (
                parallel_state.get_pipeline_model_parallel_rank(),
                parallel_state.get_tensor_model_parallel_rank(),
                parallel_state.get_data_parallel_rank(),
                parallel_state.get_expert_model_parallel_rank(),
            )
            if where != (pipeline_rank, 0, 0, 0):
                raise DualPipeConfigError(
                    f"global rank {global_rank} is at (pipeline, tensor, data, expert) {where}, "
                    f"not ({pipeline_rank}, 0, 0, 0): Megatron's rank order is not the one "
                    "assumed"
                )
            chunks = _build(args, pipeline_rank)
            setup = BuiltSetup(
                schedule=dualpipe_lm.schedule_of_run(args),
                pipeline=pp,
                tensor=args.tensor_model_parallel_size,
                expert=args.expert_model_parallel_size,
                data=args.data_parallel_size,
                world_size=world,
                microbatches=dualpipe_lm.num_microbatches(args),
                expert_tensor=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                bf16=bool(args.bf16),
            )
            config = _unwrapped(chunks[0]).config
            ranks = (pipeline_rank, global_rank)
            report, named = rank_report(setup, config, chunks, ranks, creations, started)
            values = {
                "vocab_size": args.padded_vocab_size,
                "world_size": world,
                "num_microbatches": setup.microbatches,
                "pipeline_schedule": setup.schedule.name,
            }
        finally:
            parallel_state.destroy_model_parallel()
            destroy_rerun_state_machine()
            if dist.is_initialized():
                dist.destroy_process_group()
    return report, named, setup, values


def _unwrapped(chunk: Any) -> Any:
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def _build(args: Any, pp_rank: int) -> list[Any]:
    """This rank's chunks on the meta device, as the patched ``get_model`` builds and wraps
    them before it moves them to the GPU and into DDP."""
    from megatron.core.pipeline_parallel.utils import (
        is_pp_first_stage,
        is_pp_last_stage,
        is_vp_first_stage,
        is_vp_last_stage,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module
    from megatron.training.arguments import core_transformer_config_from_args

    from .. import megatron_lm as dualpipe_lm
    from .pretrain_gpt import model_provider

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    with torch.device("meta"):
        if dualpipe_lm.builds_model_chunks(args):
            chunks = dualpipe_lm.build_model_chunks(
                model_provider,
                args,
                core_transformer_config_from_args,
                pp_rank=pp_rank,
                pg_collection=pgs,
            )
        else:
            vp = (
                args.virtual_pipeline_model_parallel_size
                if args.pipeline_model_parallel_size > 1
                else None
            )
            chunks = [
                model_provider(
                    pre_process=is_pp_first_stage(pgs.pp) and is_vp_first_stage(i, vp or 1),
                    post_process=is_pp_last_stage(pgs.pp) and is_vp_last_stage(i, vp or 1),
                    vp_stage=i if vp else None,
                    pg_collection=pgs,
                )
                for i in range(vp or 1)
            ]
        if not (args.fp16 or args.bf16):
            return chunks
        config = _unwrapped(chunks[0]).config
        if dualpipe_lm.places_model_chunks(args):
            return dualpipe_lm.float16_chunks(chunks, config, args, pp_rank=pp_rank)
        return [Float16Module(config, c) for c in chunks]
