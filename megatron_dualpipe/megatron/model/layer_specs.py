"""The layer specs of a GPT chunk, from Megatron-Core's own builders, for either
``transformer_impl`` (Megatron-LM's ``--transformer-impl``).

:func:`gpt_chunk_specs` gives what ``GPTModel(transformer_layer_spec=, mtp_block_spec=)``
takes for one chunk: ``get_gpt_decoder_block_spec`` and ``get_gpt_mtp_block_spec`` over the
chunk's layers of ``config.pipeline_model_parallel_layout`` (the MTP spec None where the
chunk has no MTP layer), with Transformer Engine's modules for ``transformer_engine`` and
Megatron's own for ``local``, whose linear layers can be Megatron's deferrable ones
(:mod:`..grads.deferral`). :class:`MLADotProductAttention` repairs MLA on megatron-core 0.16.1's
local spec. Which modules each builds, and the repair: docs/megatron.md, "DeepSeek-V3's
shape, and which layers build it".
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from ..grads.deferral import deferrable_layer_spec

__all__ = [
    "TRANSFORMER_IMPLS",
    "MLADotProductAttention",
    "gpt_chunk_specs",
    "local_gpt_specs",
]

#: Megatron-LM's ``--transformer-impl`` choices that build a GPT here.
TRANSFORMER_IMPLS = ("transformer_engine", "local")


class MLADotProductAttention(DotProductAttention):
    """Megatron's ``DotProductAttention`` for MLA: accepts ``k_channels`` (the query/key head
    size, used only through ``softmax_scale``, which MLA passes) and ``v_channels`` (the value
    head size, which sets the output width)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ):
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        del k_channels  # the scores' scale is softmax_scale; the key width is the query's
        if v_channels is not None:
            heads = config.num_attention_heads
            self.hidden_size_per_partition = divide(v_channels * heads, self.tp_group.size())


#: MLA submodules whose class MLASelfAttention checks by identity.
_MLA_EXACT = ("linear_q_down_proj", "linear_kv_down_proj")


def _with_attention_submodules(spec: ModuleSpec, **changes: Any) -> ModuleSpec:
    attention = spec.submodules.self_attention
    submodules = dataclasses.replace(attention.submodules, **changes)
    self_attention = dataclasses.replace(attention, submodules=submodules)
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=self_attention)
    )


def _layer_spec(spec: ModuleSpec, config: TransformerConfig, deferrable: bool) -> ModuleSpec:
    if not config.multi_latent_attention:
        return deferrable_layer_spec(spec) if deferrable else spec
    attention = spec.submodules.self_attention.submodules
    exact = {name: getattr(attention, name) for name in _MLA_EXACT}
    if attention.core_attention is DotProductAttention:
        spec = _with_attention_submodules(spec, core_attention=MLADotProductAttention)
    if deferrable:
        spec = _with_attention_submodules(deferrable_layer_spec(spec), **exact)
    return spec


def gpt_chunk_specs(
    config: TransformerConfig,
    *,
    transformer_impl: str,
    normalization: str | None = None,
    vp_stage: int | None = None,
    deferrable: bool = False,
) -> tuple[TransformerBlockSubmodules, Any]:
    """(decoder block spec, MTP block spec or None) of the chunk ``vp_stage`` of this
    pipeline rank, from Megatron's ``transformer_impl`` modules (see docs/megatron.md;
    ``deferrable`` applies to the local modules, TE layers defer through their config)."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(
            f"transformer_impl {transformer_impl!r} is not one of {', '.join(TRANSFORMER_IMPLS)}"
        )
    use_te = transformer_impl == "transformer_engine"
    normalization = normalization or config.normalization

    def adapt(spec: ModuleSpec) -> ModuleSpec:
        return spec if use_te else _layer_spec(spec, config, deferrable)

    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=normalization, vp_stage=vp_stage
    )
    block = dataclasses.replace(block, layer_specs=[adapt(s) for s in block.layer_specs])
    mtp = None
    if config.mtp_num_layers:
        # As Megatron-LM builds it: the MTP layer's transformer layer is the model's last
        # decoder layer (MoE under dense-then-MoE).
        last = get_gpt_decoder_layer_specs(
            config, use_transformer_engine=use_te, normalization=normalization
        )[-1]
        mtp = get_gpt_mtp_block_spec(
            config, adapt(last), use_transformer_engine=use_te, vp_stage=vp_stage
        )
    return block, mtp


def local_gpt_specs(
    config: TransformerConfig,
    *,
    normalization: str | None = None,
    vp_stage: int | None = None,
    deferrable: bool = False,
) -> tuple[TransformerBlockSubmodules, Any]:
    """:func:`gpt_chunk_specs` from Megatron's local modules."""
    return gpt_chunk_specs(
        config,
        transformer_impl="local",
        normalization=normalization,
        vp_stage=vp_stage,
        deferrable=deferrable,
    )
