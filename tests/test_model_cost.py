"""Per-stage costs from a model's shape: FLOPs of F, B (dX) and W (dW) against values worked
out by hand for small shapes, their sum against Megatron-LM's own FLOP count, parameters and
saved activations, Megatron's ``moe_layer_freq`` forms, and one-sentence errors."""

from __future__ import annotations

import pytest

from megatron_dualpipe.planner.model_cost import ModelShape, Work, stage_costs
from megatron_dualpipe.schedules.config_values import ConfigValueError
from megatron_dualpipe.schedules.ir import ScheduleError

# h=8, 2 heads of 4, sequence 4, ffn 16, vocabulary 10; LayerNorm and biases (defaults).
SMALL = dict(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=10)


def _one(shape: ModelShape, stage: str, *, tokens: int = 4, **kw) -> Work:
    return stage_costs(shape, [stage], tokens=tokens, **kw)[0].work


def test_attention_and_dense_mlp_by_hand() -> None:
    shape = ModelShape(**SMALL, ffn_hidden_size=16)
    # Per token: QKV 2*8*(2*4 + 2*2*4) = 384, output projection 2*(2*4)*8 = 128, MLP
    # 2*(16*8 + 16*8) = 512: each again in dX and in dW. Scores and values, causal:
    # 2 * 2*4 * 4/2 * 2 = 64 forward, twice that in dX, no dW.
    assert _one(shape, "t", tokens=1) == Work(1088, 1152, 1024)
    assert _one(shape, "t", tokens=4) == Work(4 * 1088, 4 * 1152, 4 * 1024)
    # The second layer costs the same; a stage of two is the sum.
    assert _one(shape, "tt", tokens=1) == Work(2 * 1088, 2 * 1152, 2 * 1024)


def test_query_groups_and_swiglu_by_hand() -> None:
    shape = ModelShape(
        **{**SMALL, "num_attention_heads": 4},
        num_query_groups=2,
        ffn_hidden_size=8,
        swiglu=True,
    )
    # Heads of 2: QKV 2*8*(4*2 + 2*2*2) = 256, output 2*8*8 = 128, scores 2*4*2*2*2 = 64;
    # SwiGLU stacks gate and up: 2*(2*8*8 + 8*8) = 384.
    assert _one(shape, "t", tokens=1) == Work(832, 896, 768)


def test_multi_latent_attention_by_hand() -> None:
    mla = dict(
        **{**SMALL, "hidden_size": 16},
        ffn_hidden_size=1,
        multi_latent_attention=True,
        kv_lora_rank=4,
        qk_head_dim=3,
        qk_pos_emb_head_dim=2,
        v_head_dim=5,
    )
    mlp = Work.gemm(2 * (16 + 16))  # ffn 1: up 16 and down 16 weights
    # q down and up 4*(16 + 2*5) = 104, kv down 16*(4+2) = 96, kv up 4*2*(3+5) = 64,
    # output 2*5*16 = 160: 424 weights, 848 FLOPs; scores 2*2*5*2 = 40, values 2*2*5*2 = 40.
    assert _one(ModelShape(**mla, q_lora_rank=4), "t", tokens=1) == Work(928, 1008, 848) + mlp
    # Without q_lora_rank the query is projected at once: 16*2*5 = 160 weights, not 104.
    assert _one(ModelShape(**mla), "t", tokens=1) == Work(1040, 1120, 960) + mlp


def test_moe_experts_top_k_and_shared_expert_by_hand() -> None:
    shape = ModelShape(
        **{**SMALL, "num_layers": 1},
        ffn_hidden_size=16,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=4,
        moe_shared_expert_intermediate_size=8,
    )
    dense = ModelShape(**{**SMALL, "num_layers": 1}, ffn_hidden_size=16)
    attention = _one(dense, "t", tokens=1) + Work.gemm(-512)  # the dense MLP taken out
    # Router 2*8*4 = 64, two routed experts 2*2*(4*8 + 4*8) = 256, shared 2*(8*8 + 8*8) = 256.
    assert _one(shape, "t", tokens=1) == attention + Work.gemm(576)
    params = stage_costs(shape, ["t"], tokens=1, expert_parallel=2)[0]
    assert params.expert_params == 4 * (4 * 8 + 4 * 8) / 2  # four experts over EP=2


def test_output_layer_loss_embedding_and_mtp_by_hand() -> None:
    shape = ModelShape(**SMALL, ffn_hidden_size=16, mtp_num_layers=1)
    # Logits 2*8*10 = 160 per token, each again in dX and dW; the loss 4 (F) and 3 (B) per
    # logit; with MTP a second head.
    assert _one(shape, "L", tokens=1) == Work(2 * 200, 2 * 190, 2 * 160)
    # The embedding's dW adds each token's gradient row: 8 per token.
    assert _one(shape, "E", tokens=4) == Work(0, 0, 32)
    # An MTP layer is a decoder layer (of the last layer's kind) plus eh_proj, 2*(2*8)*8.
    assert _one(shape, "m", tokens=1) == Work(1088, 1152, 1024) + Work.gemm(256)


def test_tensor_parallel_divides_the_work() -> None:
    shape = ModelShape(**SMALL, ffn_hidden_size=16)
    assert _one(shape, "tL", tensor_parallel=2) == _one(shape, "tL") * 0.5


def test_parameters_and_activations_by_hand() -> None:
    shape = ModelShape(**SMALL, ffn_hidden_size=16)
    (layer,) = stage_costs(shape, ["t"], tokens=4, activation_bytes=4)
    # Attention 192 + 64 weights, 32 biases, LayerNorm 16; MLP 256 weights, 24 biases, 16.
    assert layer.dense_params == 600
    # Saved per token: the norm inputs and the projections' inputs 4*8, Q, K, V and the
    # attention output 4*8, the MLP's up output and activation 2*16; fp32: 2 softmax
    # statistics. 4 bytes each, 4 tokens.
    assert layer.activations == 4 * (4 * (32 + 32 + 32) + 4 * 2)
    (loss,) = stage_costs(shape, ["L"], tokens=4, activation_bytes=4)
    # The final norm's and the output layer's inputs (2*8), the fp32 softmax over 10 logits.
    assert loss.activations == 4 * (4 * 16 + 4 * 10)
    assert loss.output_layer and not loss.embedding


def _megatron_lm_flops(shape: ModelShape, tokens: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` (transformer branch) for ``shape``,
    re-derived here for MLA with q_lora_rank, SwiGLU MoE with a shared expert, and MTP."""
    h, n, s = shape.hidden_size, shape.num_attention_heads, shape.seq_length
    dn, r, v = shape.qk_head_dim, shape.qk_pos_emb_head_dim, shape.v_head_dim
    lq, lkv = shape.q_lora_rank, shape.kv_lora_rank
    moe = sum(shape.is_moe(i) for i in range(shape.num_layers))
    mtp = shape.mtp_layers
    moe_layers = moe + mtp * shape.is_moe(shape.num_layers - 1)
    dense_layers = shape.num_layers + mtp - moe_layers
    attention = 6 * (
        lq * (h + n * (dn + r) + 1)
        + lkv * (h + n * (dn + v) + 1)
        + h * r
        + n * v * h
        + s * n * (dn + r) / 2
        + s * n * v / 2
    )
    mlp = (
        6
        * h
        * (
            shape.ffn * 3 * dense_layers
            + (shape.moe_ffn_hidden_size * shape.moe_router_topk * 3) * moe_layers
            + shape.moe_shared_expert_intermediate_size * 3 * moe_layers
        )
    )
    return tokens * (
        mlp
        + attention * (shape.num_layers + mtp)
        + 6 * mtp * (3 * h + 2 * h * h)
        + 6 * h * shape.vocab_size * (mtp + 1)
    )


def test_the_sum_is_megatron_lms_count_plus_router_loss_and_embedding() -> None:
    shape = ModelShape(
        num_layers=6,
        hidden_size=256,
        num_attention_heads=4,
        seq_length=128,
        vocab_size=1000,
        ffn_hidden_size=512,
        swiglu=True,
        multi_latent_attention=True,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_head_dim=32,
        qk_pos_emb_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_shared_expert_intermediate_size=64,
        moe_layer_freq="[0]*2+[1]*4",
        mtp_num_layers=1,
    )
    tokens = 2 * 128
    ours = sum(c.work.total for c in stage_costs(shape, ["Ettt", "ttt", "mL"], tokens=tokens))
    h, v = shape.hidden_size, shape.vocab_size
    moe_layers = 4 + 1  # and the MTP layer, of the last layer's kind
    ours_only = tokens * (
        moe_layers * 3 * 2 * h * 8  # the router
        + 2 * 7 * v  # the loss of the two heads
        + h  # the embedding's dW
    )
    # Megatron-LM counts norms of MLA's low-rank paths and MTP's norms, which we do not.
    megatron_only = tokens * 6 * (7 * (64 + 32) + 3 * h)
    assert ours - ours_only == pytest.approx(_megatron_lm_flops(shape, tokens) - megatron_only)


@pytest.mark.parametrize(
    ("freq", "pattern"),
    [
        (1, [1, 1, 1, 1, 1]),
        (2, [1, 0, 1, 0, 1]),
        ([0, 1, 1, 0, 1], [0, 1, 1, 0, 1]),
        ("[0]*2+[1]*3", [0, 0, 1, 1, 1]),
        ("([0]*1+[1]*4)", [0, 1, 1, 1, 1]),
        ("[0,1]*2+[1]", [0, 1, 0, 1, 1]),
    ],
)
def test_moe_layer_freq_reads_megatrons_forms(freq: object, pattern: list[int]) -> None:
    shape = ModelShape(**{**SMALL, "num_layers": 5}, num_experts=2, moe_layer_freq=freq)
    assert [int(shape.is_moe(i)) for i in range(5)] == pattern
    assert shape.is_moe(7) == bool(pattern[-1])  # MTP layers: the last layer's kind


@pytest.mark.parametrize(
    ("freq", "message"),
    [
        ("[0]*2+[1]*2", "must list num_layers = 5 entries"),
        ("__import__('os')", "expected an integer, a list"),
        ("[0]*2+[2]*3", "0 \\(dense\\) or 1 \\(MoE\\)"),
        (0, "must be >= 1"),
        (True, "expected an integer or a list"),
        ("3", "without quotes"),
    ],
)
def test_a_bad_moe_layer_freq_is_one_sentence(freq: object, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        ModelShape(**{**SMALL, "num_layers": 5}, num_experts=2, moe_layer_freq=freq)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"hidden_size": 8}, "num_layers: required key missing"),
        ({**SMALL, "hidden_size": "8"}, "hidden_size: expected an integer, got '8'"),
        ({**SMALL, "swiglu": 1}, "swiglu: expected true or false"),
        ({**SMALL, "q_lora_rank": 0}, "q_lora_rank: must be >= 1 or null"),
        ({**SMALL, "normalization": "BatchNorm"}, "'BatchNorm' is not one of LayerNorm"),
        ({**SMALL, "num_attention_heads": 3}, "3 does not divide hidden_size 8: set kv_channels"),
        ({**SMALL, "num_experts": 2, "moe_router_topk": 3}, "must not exceed num_experts 2"),
    ],
)
def test_a_bad_shape_is_one_sentence_naming_the_key(values: dict, message: str) -> None:
    with pytest.raises(ConfigValueError, match=f"^cfg.yaml: .*{message}") as err:
        ModelShape.from_values(values, "cfg.yaml")
    assert "\n" not in str(err.value)


def test_query_groups_count_only_with_group_query_attention() -> None:
    """Megatron-LM builds ``num_query_groups`` only under ``group_query_attention``
    (``core_transformer_config_from_args``); without it every head is its own group, and
    the shape says so (configs/dense_70b_dualpipe.yaml gave 8 to a model built with 64)."""
    values = {**SMALL, "num_attention_heads": 4, "num_query_groups": 2}
    assert ModelShape.from_values(values, "cfg.yaml").num_query_groups is None
    gqa = {**values, "group_query_attention": True}
    assert ModelShape.from_values(gqa, "cfg.yaml").num_query_groups == 2
    del gqa["num_query_groups"]  # Megatron-LM's --num-query-groups defaults to 1
    assert ModelShape.from_values(gqa, "cfg.yaml").num_query_groups == 1


def _megatron_parameter_counts(rank: int, world_size: int) -> dict[str, int]:
    """Parameters of a small GQA model with dense-then-MoE layers, a shared expert and MTP,
    as Megatron-Core's local spec builds it, summed per part."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dualpipe.megatron.compat.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    parallel_state.initialize_model_parallel(1, 1)
    megatron_random.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=32,
        moe_layer_freq=[0, 1, 1],
        moe_grouped_gemm=False,
        mtp_num_layers=1,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=128,
        max_sequence_length=16,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            part = ".".join(name.split(".")[:3])
        else:  # the MTP block, or the ends: embedding, final norm, output layer
            part = "mtp" if name.startswith("mtp.") else "ends"
        counts[part] = counts.get(part, 0) + param.numel()
    return counts


@pytest.mark.slow
@pytest.mark.megatron
def test_parameters_equal_megatron_cores_model() -> None:
    from tests.multiproc import run_workers

    (theirs,) = run_workers(_megatron_parameter_counts, 1, timeout_s=240)
    shape = ModelShape(
        num_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=16,
        vocab_size=128,
        ffn_hidden_size=128,
        swiglu=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        position_embedding_type="rope",
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=32,
        moe_layer_freq=[0, 1, 1],
        mtp_num_layers=1,
    )
    layers = stage_costs(shape, ["Et", "t", "t", "m", "L"], tokens=16)
    ours = {f"decoder.layers.{i}": c.dense_params + c.expert_params for i, c in enumerate(layers)}
    ours["mtp"] = ours.pop("decoder.layers.3")
    # The embedding table and the output layer (untied), and the final norm with the loss.
    ours["ends"] = ours.pop("decoder.layers.4") + 2 * 128 * 64
    assert ours == theirs
