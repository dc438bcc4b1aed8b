"""Megatron-LM's FLOP count of one global batch of a GPT, the figure its ``--log-throughput``
divides by the iteration time and the GPUs (``num_floating_point_operations`` in
``megatron/training/training.py``, the transformer branch for unpacked sequences). Pure
Python.

What Megatron-LM counts, per token of the batch: every GEMM three times (forward, dX, dW)
at two FLOPs a multiply-add, so 6 x its multiply-adds: the attention's projections (MHA
or grouped queries; MLA's low-rank paths and their norms), the MLPs (dense, and the routed
experts a token goes to plus the shared expert), MTP's norms and projection, and the
output layer over the padded vocabulary once per head; per sample, causal attention's
scores and values, half the full products. It leaves out the router, the loss, the
embedding and every elementwise operation. The per-stage counts of :mod:`.model_cost`
(what the advisor and the simulator take) are these plus the router and the loss.
"""

from __future__ import annotations

from .model_cost import ModelShape

__all__ = ["megatron_lm_flops"]

#: Forward, dX and dW, at 2 FLOPs per multiply-add.
_GEMM = 3 * 2


def _attention_per_token(shape: ModelShape) -> float:
    """Multiply-adds of one layer's attention projections, per token."""
    h, n = shape.hidden_size, shape.num_attention_heads
    if shape.multi_latent_attention:
        dn, r, v = shape.qk_head_dim, shape.qk_pos_emb_head_dim, shape.v_head_dim
        lq, lkv = shape.q_lora_rank, shape.kv_lora_rank
        query = h * n * (dn + r) if lq is None else lq * (h + n * (dn + r) + 1)
        return query + lkv * (h + n * (dn + v) + 1) + h * r + n * v * h
    queries = shape.head_dim * n
    keys = shape.head_dim * (shape.num_query_groups or n)
    return h * (queries + 2 * keys) + queries * h


def _scores_per_position(shape: ModelShape) -> float:
    """Multiply-adds of one layer's causal scores and values, per (token, position) pair:
    half of the full ``QK^T`` and ``softmax(QK^T) V``."""
    n = shape.num_attention_heads
    if shape.multi_latent_attention:
        return n * (shape.qk_head_dim + shape.qk_pos_emb_head_dim) / 2 + n * shape.v_head_dim / 2
    return shape.head_dim * n


def megatron_lm_flops(shape: ModelShape, samples: int, padded_vocab_size: int) -> float:
    """FLOPs of one iteration over ``samples`` sequences of ``shape.seq_length`` tokens, as
    Megatron-LM counts them (the module docstring); ``padded_vocab_size`` is the output
    layer's width (the vocabulary padded as Megatron-LM pads it)."""
    h, s, mtp = shape.hidden_size, shape.seq_length, shape.mtp_layers
    layers = shape.num_layers + mtp  # MTP layers are of the last decoder layer's kind
    moe = sum(shape.is_moe(i) for i in range(layers)) if shape.num_experts else 0
    up = 3 if shape.swiglu else 2  # SwiGLU stacks the gate beside the up projection
    mlp = h * up * (
        shape.ffn * (layers - moe)
        + (shape.moe_ffn_hidden_size or shape.ffn) * shape.moe_router_topk * moe
        + (shape.moe_shared_expert_intermediate_size or 0) * moe
    )
    per_token = (
        mlp
        + _attention_per_token(shape) * layers
        + mtp * (3 * h + 2 * h * h)
        + h * padded_vocab_size * (mtp + 1)
    )
    tokens = samples * s
    return _GEMM * (tokens * per_token + samples * s * s * _scores_per_position(shape) * layers)
