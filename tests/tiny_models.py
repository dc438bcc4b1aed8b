"""Test scaffolding: a small Megatron GPT, deterministic data for it, and name-keyed
weight exchange.

Tests and ``scripts/gpu_check.py`` build the same model at every parallel layout and
check that a pipelined run gives the losses and gradients of a single-process run. What
makes that checkable is a layout-independent name for every parameter, its *global name*:
the name the parameter has in an unpipelined model with one expert-parallel rank.
A pipeline stage's ``decoder.layers.K`` becomes ``decoder.layers.G`` with ``G`` the
layer's global index (Megatron's layer offset, as stored in ``layer_number``, so it
also holds for custom layouts), a local expert ``J`` becomes its global expert index,
and a last stage's tied ``output_layer.weight`` becomes
``embedding.word_embeddings.weight``.

Everything here needs ``parallel_state`` to be initialised in the calling process.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_dualpipe.megatron.compat.version import mtp_block_on_any_chunk
from megatron_dualpipe.megatron.model.layer_specs import local_gpt_specs
from megatron_dualpipe.megatron.model.names import global_named_parameters
from megatron_dualpipe.megatron.model.tied import release_unused_output_weight

__all__ = [
    "SEQ_LENGTH",
    "VOCAB_SIZE",
    "build_reference_gpt",
    "build_tiny_gpt",
    "build_tiny_gpt_chunks",
    "global_gradients",
    "global_named_parameters",
    "global_state",
    "gpt_forward_step",
    "load_global_state",
    "reference_config",
    "run_reference_step",
    "synthetic_microbatches",
    "tiny_gpt_config",
]

VOCAB_SIZE = 128
SEQ_LENGTH = 16



def tiny_gpt_config(
    *,
    num_layers: int = 8,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_moe_experts: int | None = None,
    moe_router_topk: int = 2,
    moe_token_dispatcher_type: str = "alltoall",
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    **overrides: Any,
) -> TransformerConfig:
    """TransformerConfig of a small fp32 GPT for CPU runs: no dropout, no fusions,
    CPU initialisation. With ``num_moe_experts`` the layers are MoE (every one, or as
    ``moe_layer_freq`` says; dropless, no auxiliary loss, so routing is per token and
    layout-independent) and linear layers have no bias (a biased SequentialMLP fails in
    0.16.1, in ``MLP.forward`` of transformer/mlp.py). ``overrides`` go to
    TransformerConfig as they are (e.g. ``batch_p2p_comm=False``); with
    ``multi_latent_attention=True`` the config is Megatron's MLATransformerConfig.
    """
    moe = num_moe_experts is not None
    kwargs: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        ffn_hidden_size=4 * hidden_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        add_bias_linear=not moe,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
    )
    if moe:
        kwargs.update(
            num_moe_experts=num_moe_experts,
            moe_router_topk=moe_router_topk,
            moe_token_dispatcher_type=moe_token_dispatcher_type,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
        )
    kwargs.update(overrides)
    mla = kwargs.get("multi_latent_attention", False)
    return (MLATransformerConfig if mla else TransformerConfig)(**kwargs)


def reference_config(config: TransformerConfig) -> TransformerConfig:
    """The same model without pipeline or expert parallelism (for a one-rank reference)."""
    return replace(
        config,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        pipeline_model_parallel_layout=None,
        num_layers_in_first_pipeline_stage=None,
        num_layers_in_last_pipeline_stage=None,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
    )


def build_tiny_gpt(
    config: TransformerConfig,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    share_embeddings_and_output_weights: bool = False,
    position_embedding_type: str = "learned_absolute",
    vocab_size: int = VOCAB_SIZE,
    max_sequence_length: int = SEQ_LENGTH,
    deferrable: bool = False,
) -> GPTModel:
    """One GPTModel chunk with Megatron's local (non-TE) specs (:mod:`.layer_specs`: MoE
    layers as ``moe_layer_freq`` says, MLA, the MTP block where the layout puts it; linear
    layers deferrable from construction with ``deferrable``); pre/post as given."""
    block, mtp = local_gpt_specs(config, vp_stage=vp_stage, deferrable=deferrable)
    with mtp_block_on_any_chunk():
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            mtp_block_spec=mtp,
            vp_stage=vp_stage,
        )
    release_unused_output_weight(chunk)
    return chunk


def build_tiny_gpt_chunks(config: TransformerConfig, **model_kwargs: Any) -> list[GPTModel]:
    """This rank's model chunks (one per virtual stage) in Megatron's standard placement."""
    vp = config.virtual_pipeline_model_parallel_size
    stages: Sequence[int | None] = [None] if vp is None else range(vp)
    return [
        build_tiny_gpt(
            config,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=s),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=s),
            vp_stage=s,
            **model_kwargs,
        )
        for s in stages
    ]


def build_reference_gpt(config: TransformerConfig, **model_kwargs: Any) -> GPTModel:
    """The whole model in one chunk; needs PP = EP = 1 in ``parallel_state``."""
    return build_tiny_gpt(
        reference_config(config), pre_process=True, post_process=True, **model_kwargs
    )


def global_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of a chunk's parameters by global name (picklable); tensor-parallel
    parts are gathered whole (collective over the TP group)."""
    return {
        n: _tp_gather(p, p.detach().clone()) for n, p in global_named_parameters(model).items()
    }


def load_global_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy values into a chunk's parameters by global name.

    Every parameter of the chunk must be in ``state`` with the same shape; ``state``
    may hold more (a stage holds a part of the reference model).
    """
    params = global_named_parameters(model)
    missing = sorted(set(params) - set(state))
    if missing:
        raise KeyError(f"no value for parameters {missing}")
    with torch.no_grad():
        for name, param in params.items():
            value = _tp_shard(param, state[name])
            if param.shape != value.shape:
                raise ValueError(f"{name}: shape {tuple(param.shape)} != {tuple(value.shape)}")
            param.copy_(value)


def _tp_split(param: torch.nn.Parameter) -> int | None:
    """The dimension a tensor-parallel parameter is split along (None if replicated)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return param.partition_dim


def _tp_shard(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This tensor-parallel rank's part of ``full`` (contiguous blocks, Megatron's split)."""
    dim = _tp_split(param)
    if dim is None:
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return full.chunk(tp, dim=dim)[parallel_state.get_tensor_model_parallel_rank()]


def _tp_gather(param: torch.nn.Parameter, part: torch.Tensor) -> torch.Tensor:
    """The whole tensor from every tensor-parallel rank's ``part`` (collective)."""
    dim = _tp_split(param)
    if dim is None:
        return part
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(part) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def global_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of a chunk's gradients by global name: ``main_grad`` under Megatron's DDP,
    else ``grad``; tensor-parallel parts are gathered whole (collective over the TP group);
    parameters without a gradient are left out."""
    grads = {}
    for name, param in global_named_parameters(model).items():
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        if grad is not None:
            grads[name] = _tp_gather(param, grad.detach().clone())
    return grads


# --------------------------------------------------------------------------------------
# Data, forward step, reference step.


def synthetic_microbatches(
    num_microbatches: int,
    *,
    micro_batch_size: int,
    seq_length: int = SEQ_LENGTH,
    vocab_size: int = VOCAB_SIZE,
    seed: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """Deterministic micro-batches from ``seed``: each a dict with ``tokens``,
    ``labels`` (the tokens shifted by one), ``position_ids``, a causal boolean
    ``attention_mask`` [b, 1, s, s] (True = masked) and a ``loss_mask`` of ones."""
    generator = torch.Generator().manual_seed(seed)
    position_ids = torch.arange(seq_length).expand(micro_batch_size, seq_length)
    causal = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)
    attention_mask = causal.expand(micro_batch_size, 1, seq_length, seq_length)
    batches = []
    for _ in range(num_microbatches):
        text = torch.randint(vocab_size, (micro_batch_size, seq_length + 1), generator=generator)
        batches.append(
            {
                "tokens": text[:, :-1].contiguous(),
                "labels": text[:, 1:].contiguous(),
                "position_ids": position_ids.clone(),
                "attention_mask": attention_mask.clone(),
                "loss_mask": torch.ones(micro_batch_size, seq_length),
            }
        )
    return batches


def _masked_mean(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> torch.Tensor:
    losses = output_tensor.float()
    mask = loss_mask.float()
    return (losses * mask).sum() / mask.sum()


def _loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = _masked_mean(loss_mask, output_tensor)
    # Megatron's forward_step_calc_loss (pipeline_parallel/schedules.py) divides the
    # returned loss in place: clone.
    return loss, {"loss": loss.detach().clone()}


def _forward(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )


def gpt_forward_step(
    data_iterator: Iterator[Mapping[str, torch.Tensor]],
    model: torch.nn.Module,
    return_schedule_plan: bool = False,
) -> tuple[Any, Any]:
    """``forward_step_func`` for Megatron's schedules: takes the next micro-batch from
    ``data_iterator`` (every stage reads its own iterator over the same batches) and
    returns the output (or, with ``return_schedule_plan``, the GPTModel's schedule plan for
    MoE all-to-all overlap) with a loss function giving the masked mean token loss."""
    batch = next(data_iterator)
    loss_func = partial(_loss_func, batch["loss_mask"])
    if return_schedule_plan:
        plan = model.build_schedule_plan(
            batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
        )
        return plan, loss_func
    return _forward(model, batch), loss_func


def run_reference_step(
    model: torch.nn.Module, microbatches: Sequence[Mapping[str, torch.Tensor]]
) -> list[float]:
    """Forward and backward every micro-batch in order on a one-stage model, each loss
    weighted by 1/len(microbatches) as Megatron's schedules do (the MTP loss too, through
    Megatron's ``MTPLossAutoScaler``); returns the losses."""
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / len(microbatches)))
    losses = []
    for batch in microbatches:
        loss = _masked_mean(batch["loss_mask"], _forward(model, batch))
        (loss / len(microbatches)).backward()
        losses.append(loss.item())
    return losses
