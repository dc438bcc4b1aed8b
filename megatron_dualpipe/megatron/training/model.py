"""Build this rank's model chunks for a :class:`~.config.TrainConfig`.

A GPT (dense, MoE when ``num_experts`` is set, dense-then-MoE with ``moe_layer_freq``;
multi-latent attention, MTP layers, tied embeddings) from Megatron-Core's layer specs for
``transformer_impl`` (:mod:`..layer_specs`; :func:`transformer_impl` resolves the default),
cut by the schedule's placement (V for dualpipev, mirrored copies for dualpipe, Megatron's
own split otherwise; uneven as the split keys say), initialised layout-independently,
wrapped in Megatron's DistributedDataParallel, with the config hooks Megatron's training
loop sets. The chunks are assembled by :func:`..chunks.build_chunks`, as the Megatron-LM
route assembles them (tied copies, dW deferral); the MTP block's copy of the position table
on another rank is one parameter with the original (:mod:`..position_copies`).

``transformer_engine`` builds what Megatron-LM builds by default: Transformer Engine's
layers with Megatron-LM's default fusions (bias-activation, bias-dropout-add, masked
softmax, RoPE where Megatron supports it), grouped GEMM for the experts, and
``gradient_accumulation_fusion`` where APEX's ``fused_weight_gradient_mlp_cuda`` is
installed (GPTModel's output layer is Megatron's own linear, which needs that kernel; TE's
layers fuse on their own). ``local`` keeps every fusion off (CPU).

With ``bf16`` every chunk is wrapped in Megatron's ``Float16Module`` (our placements: in
:class:`~..precision.StageFloat16Module`, which knows where the loss is), as Megatron-LM does.

Initialisation: every parameter is drawn from a generator seeded by ``(seed, global
parameter name, tensor-parallel rank)``, so the weights do not depend on the pipeline
schedule or on which rank holds which layer (Megatron's own initialisation draws from
per-pipeline-rank streams). Rules: matrices N(0, init_method_std), the output projections
of attention and MLP (``linear_proj``, ``linear_fc2``) N(0, init_method_std /
sqrt(2 num_layers)); biases 0; normalisation weights 1. Megatron builds with
``perform_initialization`` off; megatron-core before 0.18 then leaves the weights of its
vocabulary-, column- and row-parallel layers without their tensor-parallel marks, which
Megatron's gradient norm needs to count every rank's shard: :func:`mark_tensor_parallel`
sets them as Megatron's initialisation would.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from ..compat.version import (
    cuda_graph_config,
    mtp_block_on_any_chunk,
    tensor_parallel_marks_without_initialisation,
)
from ..grads.mirror import prepare_mirrors
from ..model.chunks import ChunkEnds, build_chunks, ddp_config, model_config
from ..model.layer_specs import gpt_chunk_specs, te_available
from ..model.names import global_named_parameters
from ..model.placement import StagePlacementLayout
from ..model.position_copies import finalize_model_grads, mark_position_copies
from ..model.precision import StageFloat16Module
from ..schedule.checks import schedule_spec
from .config import TrainConfig

__all__ = [
    "build_chunks_here",
    "build_model",
    "in_precision",
    "mark_tensor_parallel",
    "transformer_config",
    "transformer_impl",
]

_SCALED_OUTPUTS = ("linear_proj.weight", "linear_fc2.weight")


def transformer_impl(cfg: TrainConfig) -> str:
    """``cfg.transformer_impl``, or where unset ``transformer_engine`` when this process has
    CUDA and Transformer Engine, else ``local``."""
    if cfg.transformer_impl is not None:
        return cfg.transformer_impl
    return "transformer_engine" if te_available() else "local"


def _fusions(cfg: TrainConfig, impl: str) -> dict[str, bool]:
    """Megatron-LM's default fusions where they apply (module docstring)."""
    te = impl == "transformer_engine"
    rope = cfg.position_embedding_type == "rope" or cfg.multi_latent_attention
    mla_rope_ok = not cfg.multi_latent_attention or cfg.rope_type in (None, "yarn")
    return dict(
        # Megatron fuses the bias into SwiGLU, and GeLU only where there is a bias.
        bias_activation_fusion=te and (cfg.swiglu or cfg.add_bias_linear),
        bias_dropout_fusion=te,
        masked_softmax_fusion=te,
        apply_rope_fusion=te and rope and mla_rope_ok,
        gradient_accumulation_fusion=te
        and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
    )


def transformer_config(cfg: TrainConfig, *, on_gpu: bool) -> TransformerConfig:
    """Megatron's TransformerConfig for ``cfg`` (raises Megatron's own errors); with
    Transformer Engine layers under a schedule that splits the backward, with
    ``delay_wgrad_compute`` (:func:`..chunks.model_config`)."""
    impl = transformer_impl(cfg)
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        qk_layernorm=cfg.qk_layernorm,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=cfg.normalization,
        add_bias_linear=cfg.add_bias_linear,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        sequence_parallel=cfg.sequence_parallel,
        **_split(cfg),
        # Megatron's P2P with two chunks per rank at PP=2 and batched P2P gives wrong
        # gradients (Megatron-LM #750); our schedules do not use Megatron's P2P.
        batch_p2p_comm=cfg.model_chunks == 1,
        bf16=cfg.bf16,
        overlap_moe_expert_parallel_comm=cfg.overlap_moe_expert_parallel_comm,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        deallocate_pipeline_outputs=True,  # as Megatron-LM's core_transformer_config_from_args
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,  # see init_weights
        **_fusions(cfg, impl),
    )
    if cfg.recompute_granularity is not None:
        kwargs.update(
            recompute_granularity=cfg.recompute_granularity,
            recompute_method=cfg.recompute_method,
            recompute_num_layers=cfg.recompute_num_layers,
        )
        if cfg.recompute_modules is not None:
            kwargs["recompute_modules"] = cfg.recompute_modules.split()
    kwargs.update(
        cuda_graph_config(
            cfg.cuda_graph_impl, cfg.cuda_graph_module_names, cfg.cuda_graph_warmup_steps
        )
    )
    if cfg.fp8 is not None:  # Transformer Engine's FP8 layers (launch refuses it on local)
        kwargs.update(fp8=cfg.fp8, fp8_recipe=cfg.fp8_recipe)
    if cfg.swiglu:
        kwargs.update(gated_linear_unit=True, activation_func=F.silu)
    if cfg.mtp_num_layers:
        kwargs.update(
            mtp_num_layers=cfg.mtp_num_layers, mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor
        )
    if cfg.multi_latent_attention:
        kwargs.update(
            multi_latent_attention=True,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_head_dim,
            qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
            v_head_dim=cfg.v_head_dim,
        )
        if cfg.rope_type is not None:
            kwargs["rope_type"] = cfg.rope_type
    if cfg.is_moe:
        kwargs.update(
            num_moe_experts=cfg.num_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
            moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
            moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_router_dtype=cfg.moe_router_dtype,
            moe_grouped_gemm=impl == "transformer_engine",
            moe_layer_freq=cfg.moe_layer_pattern,
            moe_router_score_function=cfg.moe_router_score_function,
            moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
            moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
        )
    config_class = MLATransformerConfig if cfg.multi_latent_attention else TransformerConfig
    return model_config(config_class(**kwargs), cfg.pipeline_schedule, impl)


def _split(cfg: TrainConfig) -> dict[str, Any]:
    """How the layers split over the pipeline, in TransformerConfig's keys: our schedules'
    placements as a :class:`StagePlacementLayout` of the model stages' layer counts;
    Megatron's own settings as they are otherwise."""
    if schedule_spec(cfg.pipeline_schedule).places_chunks:
        layout = StagePlacementLayout(
            cfg.pipeline_schedule,
            cfg.pipeline_model_parallel_size,
            cfg.stage_layers(),
            cfg.mtp_num_layers,
        )
        return {"pipeline_model_parallel_layout": layout}
    return dict(
        num_layers_in_first_pipeline_stage=cfg.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=cfg.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=cfg.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=cfg.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=cfg.pipeline_model_parallel_layout,
    )


def _chunk_ends(cfg: TrainConfig, config: TransformerConfig) -> list[ChunkEnds]:
    """Where each local chunk sits, chunk 0 first."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    layout = config.pipeline_model_parallel_layout
    if isinstance(layout, StagePlacementLayout):
        return [ChunkEnds(r.pre_process, r.post_process, r.chunk) for r in layout.roles(pp_rank)]
    stages: list[int | None] = (
        list(range(cfg.virtual_pipeline_model_parallel_size))
        if cfg.virtual_pipeline_model_parallel_size
        else [None]
    )
    return [
        ChunkEnds(
            parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=s),
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=s),
            s,
        )
        for s in stages
    ]


def _name_seed(seed: int, name: str, tp_rank: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{tp_rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def mark_tensor_parallel(chunk: torch.nn.Module) -> None:
    """Give every weight of Megatron's ``VocabParallelEmbedding``, ``ColumnParallelLinear``
    and ``RowParallelLinear`` (and their subclasses, the deferrable linears) in ``chunk``
    that lacks them the tensor-parallel marks Megatron's initialisation sets
    (``set_tensor_model_parallel_attributes``: split along 0, 0 and 1; stride 1, but 2 for
    an MLP's ``linear_fc1`` of a gated linear unit, as ``MLP`` passes it). Nothing to do on
    megatron-core 0.18 and newer, which marks them without initialising
    (:func:`..version.tensor_parallel_marks_without_initialisation`). Transformer
    Engine's layers mark their own weights."""
    if tensor_parallel_marks_without_initialisation():
        return
    strides = {
        id(m.linear_fc1): 2 if m.config.gated_linear_unit and not m.config.use_kitchen else 1
        for m in chunk.modules()
        if isinstance(m, MLP)
    }
    for module in chunk.modules():
        if isinstance(module, VocabParallelEmbedding | ColumnParallelLinear):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = module.weight
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, strides.get(id(module), 1))


@torch.no_grad()
def init_weights(chunk: torch.nn.Module, cfg: TrainConfig) -> None:
    """Initialise ``chunk`` by global parameter name (see the module docstring)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    scaled_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    for name, param in global_named_parameters(chunk).items():
        if param.dim() == 1:
            param.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        generator = torch.Generator(device=param.device)
        generator.manual_seed(_name_seed(cfg.seed, name, tp_rank))
        std = scaled_std if name.endswith(_SCALED_OUTPUTS) else cfg.init_method_std
        param.normal_(0.0, std, generator=generator)


def build_chunks_here(
    cfg: TrainConfig,
    config: TransformerConfig,
    vocab_size: int | None = None,
    *,
    initialise: bool = True,
) -> tuple[list[torch.nn.Module], list[ChunkEnds]]:
    """This rank's chunks as Megatron-Core builds them, before any wrapper, and where each
    sits (chunk 0 first): GPTModels from the layer specs, assembled by
    :func:`..chunks.build_chunks`, the MTP block's position-table copy marked. Needs
    ``parallel_state``. ``initialise``: draw the weights (:func:`init_weights`; off for a
    build on the meta device, which holds no values). Modules are made on the current
    default device (under ``torch.device("meta")``: nothing is allocated), then moved to
    the GPU where there is one and ``initialise`` is set."""
    found = schedule_spec(cfg.pipeline_schedule)
    impl = transformer_impl(cfg)

    def build(ends: ChunkEnds) -> torch.nn.Module:
        block, mtp = gpt_chunk_specs(
            config,
            transformer_impl=impl,
            normalization=cfg.normalization,
            vp_stage=ends.vp_stage,
            deferrable=found.splits_backward,
        )
        with mtp_block_on_any_chunk():
            chunk = GPTModel(
                config=config,
                transformer_layer_spec=block,
                vocab_size=vocab_size or cfg.vocab_size,
                max_sequence_length=cfg.max_position_embeddings or cfg.seq_length,
                pre_process=ends.pre_process,
                post_process=ends.post_process,
                share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
                position_embedding_type=cfg.position_embedding_type,
                mtp_block_spec=mtp,
                vp_stage=ends.vp_stage,
            )
        mark_tensor_parallel(chunk)
        if initialise:
            if torch.cuda.is_available():
                chunk.cuda(torch.cuda.current_device())
            init_weights(chunk, cfg)  # copies of one parameter get its values: same name
        return chunk

    ends = _chunk_ends(cfg, config)
    chunks = build_chunks(build, ends, cfg.pipeline_schedule)
    mark_position_copies(chunks)  # the MTP block's position table on another rank
    return chunks, ends


def in_precision(
    cfg: TrainConfig,
    config: TransformerConfig,
    chunks: list[torch.nn.Module],
    ends: list[ChunkEnds],
) -> list[torch.nn.Module]:
    """``chunks`` as training runs them: with ``bf16`` each in Megatron-LM's
    ``Float16Module`` (our placements: :class:`~..precision.StageFloat16Module`, with the
    ends the placement gives), which casts every parameter to bf16; else as they are."""
    if not cfg.bf16:
        return chunks
    places = schedule_spec(cfg.pipeline_schedule).places_chunks
    return [
        StageFloat16Module(config, c, pre_process=e.pre_process, post_process=e.post_process)
        if places
        else Float16Module(config, c)
        for c, e in zip(chunks, ends, strict=True)
    ]


def build_model(
    cfg: TrainConfig, config: TransformerConfig, vocab_size: int | None = None
) -> list[DistributedDataParallel]:
    """This rank's chunks, initialised and wrapped in DDP; ``config`` gets the hooks
    (``no_sync_func``, ``finalize_model_grads_func``). Needs ``parallel_state``.
    ``vocab_size``: the embedding's rows (default ``cfg.vocab_size``; a tokenizer's padded
    vocabulary, :mod:`.tokenizer`).

    Under schedules that split the backward every linear layer defers its weight gradient
    (dW) to the W actions (local layers built so from the layer spec, the output layer
    converted, TE layers hooked: :func:`..chunks.build_chunks`); dualpipe's mirrored copies
    are made equal.
    """
    found = schedule_spec(cfg.pipeline_schedule)
    chunks = in_precision(cfg, config, *build_chunks_here(cfg, config, vocab_size))
    ddp = ddp_config(
        cfg.pipeline_schedule,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        grad_reduce_in_fp32=cfg.bf16,
    )
    # Megatron-LM buckets the first chunk only; dualpipe's mirror sum needs both copies of a
    # stage bucketed alike (see prepare_mirrors): one bucket per chunk there.
    mirror = found.placement == "mirror"
    model = [
        DistributedDataParallel(config, ddp, chunk, disable_bucketing=i > 0 or mirror)
        for i, chunk in enumerate(chunks)
    ]
    if mirror:
        prepare_mirrors(model, timeout_s=60.0 * cfg.distributed_timeout_minutes)
    config.finalize_model_grads_func = finalize_model_grads
    if cfg.overlap_grad_reduce:
        no_sync = [m.no_sync for m in model]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return model
