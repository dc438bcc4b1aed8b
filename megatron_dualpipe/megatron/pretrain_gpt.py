"""GPT pretraining through Megatron-LM's own training loop (``megatron.training.pretrain``)
with megatron-dualpipe's ``--pipeline-schedule``.

This project's equivalent of Megatron-LM's ``pretrain_gpt.py``, which the megatron-core
wheel does not ship: the model provider, the batch, the loss and the datasets, for 0.19's
patched ``megatron/training`` (an unpatched one is refused in one sentence). Every flag is
Megatron-LM's; ``--pipeline-schedule`` is ours. ``scripts/pretrain_gpt_megatron_lm.py`` and
``megatron-dualpipe train`` (:mod:`.lm_launch`) run :func:`main`. How to run it:
docs/training.md, "Where the ranks come from".
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from functools import partial
from importlib.util import find_spec
from typing import Any

import torch

from .. import megatron_lm as dualpipe_lm

#: The fields of a batch, in the order :func:`get_batch` returns them.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config: Any = None,
    pg_collection: Any = None,
) -> Any:
    """One GPTModel chunk from Megatron's decoder block spec (Transformer Engine's with
    ``--transformer-impl transformer_engine``, else the local one) and its MTP block spec,
    as Megatron-LM's ``gpt_builder`` builds them, through ``train``'s
    :func:`~megatron_dualpipe.megatron.model.layer_specs.gpt_chunk_specs` (which also
    repairs multi-latent attention on the local spec: Megatron's local ``DotProductAttention``
    takes no ``k_channels``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from .model.layer_specs import gpt_chunk_specs

    args = get_args()
    config = config if config is not None else core_transformer_config_from_args(args)
    block, mtp = gpt_chunk_specs(
        config,
        transformer_impl=args.transformer_impl,
        normalization=args.normalization,
        vp_stage=vp_stage,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        mtp_block_spec=mtp,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def get_batch(data_iterator: Iterator[dict[str, Any]] | None) -> tuple[Any, ...]:
    """This micro-batch's :data:`BATCH_KEYS` on this rank: read by tensor-parallel rank 0,
    broadcast to the others (every field: under dualpipe and dualpipev a data rank holds
    both an embedding and a loss); Nones on a rank that reads no data."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args

    args = get_args()
    if data_iterator is None and mpu.get_tensor_model_parallel_world_size() == 1:
        return (None,) * len(BATCH_KEYS)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict[str, Any] = {}
    if tp_rank == 0:
        read = next(data_iterator)
        # On the current device (without a GPU, megatron_training_on_cpu makes .cuda() the
        # tensor itself)
        batch = {k: None if v is None else v.cuda(non_blocking=True) for k, v in read.items()}
        batch.setdefault("attention_mask", None)
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=True,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    return tuple(batch.get(k) for k in BATCH_KEYS)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[Any, Any, dict]:
    """Megatron-LM's GPT loss: the masked sum of the token losses, the number of tokens it
    covers, and the report ``{"lm loss": [sum, tokens]}`` its training loop averages."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return (
        loss,
        num_tokens,
        {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])},
    )


def forward_step(
    data_iterator: Any, model: Any, return_schedule_plan: bool = False
) -> tuple[Any, Any]:
    """Megatron's ``forward_step_func`` contract: the chunk's output and the loss function
    to apply to it where the pipeline ends; with ``return_schedule_plan`` (what Megatron's
    combined 1F1B and our F&B overlap ask under ``--overlap-moe-expert-parallel-comm``),
    the chunk's schedule plan (``GPTModel.build_schedule_plan``) in place of its output, as
    Megatron-LM's ``pretrain_gpt.forward_step`` gives it."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    if return_schedule_plan:
        plan = model.build_schedule_plan(
            tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
        )
        return plan, partial(loss_func, loss_mask)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def _dataset_config(args: Any) -> Any:
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def _builds_data(vp_stage: int | None = None) -> bool:
    """Datasets are built where batches are read: tensor-parallel rank 0 of the first and
    the last pipeline stage (our placements keep the embedding and the loss there)."""
    from megatron.core import mpu
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)


def train_valid_test_datasets_provider(
    num_samples: Sequence[int], vp_stage: int | None = None
) -> tuple[Any, Any, Any]:
    """Megatron's GPT datasets (``MockGPTDataset`` with ``--mock-data``) for the train,
    validation and test sample counts."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args

    args = get_args()
    kind = MockGPTDataset if args.mock_data else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        kind, num_samples, partial(_builds_data, vp_stage), _dataset_config(args)
    )
    return builder.build()


train_valid_test_datasets_provider.is_distributed = True  # Megatron's "every rank calls it"


def get_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The embedding group of one pipeline: ours under dualpipe and dualpipev, else
    Megatron-LM's ``pretrain_gpt.get_embedding_ranks``: the first rank, the last with tied
    embeddings, and the ranks of the MTP layers (whose copy of the word embedding is kept
    in step with the original through this group)."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    ours = dualpipe_lm.embedding_ranks(args, pp_ranks)
    if ours is not None:
        return ours
    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1:
        if not args.untie_embeddings_and_output_weights:
            ranks.add(pp_ranks[-1])
        ranks.update(get_mtp_ranks(pp_ranks, core_transformer_config_from_args(args)))
    return sorted(ranks)


def _refuse(sentence: str) -> None:
    """``error: <sentence>`` on stderr and exit code 2, as Megatron-LM's route refuses."""
    print(f"error: {sentence}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> dualpipe_lm.MeasuredStep | None:
    """Parse Megatron-LM's arguments (``argv``, default ``sys.argv[1:]``) with
    ``--pipeline-schedule``, and run ``pretrain`` (on a machine without a GPU, on CPU ranks
    over gloo: ``cpu_compat_training.megatron_training_on_cpu``). Returns, on global rank 0
    of a run with ``--pipeline-timeline``, the measured step
    (:func:`~..megatron_lm.measured_step`), else None.
    Refuses, before any work, another megatron-core than 0.19 and an unpatched
    ``megatron/training``."""
    from .compat.lm_patch import unpatched_training_problem
    from .compat.version import installed_megatron_core, route_training_installed

    if not route_training_installed():
        raise SystemExit(
            f"error: this script runs megatron-core 0.19's megatron.training (pretrain with a "
            f"config container), but megatron-core {installed_megatron_core()} is installed: "
            "pip install 'megatron-core==0.19.2', or apply your tag's patch to Megatron-LM "
            "and run its pretrain_gpt.py"
        )
    problem = unpatched_training_problem()
    if problem is not None:
        _refuse(problem)
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from .compat.cpu_compat_training import (
        megatron_training_on_cpu,
        skip_compiling_shipped_dataset_helpers,
    )

    with megatron_training_on_cpu():  # a no-op with CUDA; validate_args asks the device too
        saved = sys.argv
        sys.argv = [saved[0], *(saved[1:] if argv is None else argv)]
        try:
            args = parse_and_validate_args(
                extra_args_provider=dualpipe_lm.add_arguments,
                args_defaults={"tokenizer_type": "NullTokenizer"},
            )
        finally:
            sys.argv = saved
        no_te = find_spec("transformer_engine") is None
        if args.transformer_impl == "transformer_engine" and no_te:
            _refuse(
                "--transformer-impl transformer_engine (Megatron-LM's default) needs Transformer "
                "Engine, which is not installed: pip install -e '.[te]' on a machine with CUDA, "
                "or pass --transformer-impl local"
            )
        with warnings.catch_warnings():
            # "use a ModelConfig instead of a model provider": the placement needs the provider
            warnings.filterwarnings("ignore", message=r"\s*It is recommended to use a ModelConfig")
            cfg = pretrain_cfg_container_from_args(args)
        skip_compiling_shipped_dataset_helpers()  # the wheel's helpers are built already
        pretrain(
            cfg,
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            model_provider=model_provider,
            get_embedding_ranks=get_embedding_ranks,
        )
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun's global rank, as Megatron-LM reads it
        return None
    return dualpipe_lm.measured_step(args)
