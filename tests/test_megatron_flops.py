"""``train``'s ``log_throughput`` counts FLOPs as Megatron-LM does: ours against
``megatron.training.training.num_floating_point_operations`` itself (the 0.19 wheel ships
it), for a dense GPT with grouped queries and SwiGLU, a MoE model with a shared expert,
expert layers from a pattern and MTP, and MLA. Megatron's function runs in a forked child:
this process must not import a ``megatron.training`` (the loop tests' ranks import the
patched copy)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import megatron.core
import pytest

from megatron_dualpipe.planner.megatron_flops import megatron_lm_flops
from megatron_dualpipe.planner.model_cost import ModelShape, parse_moe_layer_freq
from tests.multiproc import run_workers

pytestmark = pytest.mark.megatron

SHAPES = {
    "gqa-swiglu": dict(
        num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
        seq_length=128, vocab_size=1000, ffn_hidden_size=704, swiglu=True,
    ),
    "moe-shared-mtp": dict(
        num_layers=5, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=500,
        num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96,
        moe_shared_expert_intermediate_size=64, moe_layer_freq="[0]*2+[1]*3", mtp_num_layers=1,
    ),
    "mla": dict(
        num_layers=3, hidden_size=192, num_attention_heads=4, seq_length=32, vocab_size=300,
        multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16,
        qk_pos_emb_head_dim=8, v_head_dim=16, kv_channels=16,
    ),
}  # fmt: skip
SAMPLES, PADDED_VOCAB = 6, 1024
SHIPS_TRAINING = (Path(megatron.core.__file__).resolve().parents[1] / "training").is_dir()


def _megatron_args(shape: ModelShape) -> SimpleNamespace:
    """The arguments ``num_floating_point_operations`` reads, as Megatron-LM's
    ``validate_args`` leaves them for ``shape``."""
    freq = shape.moe_layer_freq
    groups = shape.num_query_groups
    return SimpleNamespace(
        hybrid_layer_pattern=None, experimental_attention_variant=None,
        group_query_attention=groups is not None, num_query_groups=groups,
        num_attention_heads=shape.num_attention_heads, num_layers=shape.num_layers,
        hidden_size=shape.hidden_size, kv_channels=shape.head_dim, seq_length=shape.seq_length,
        ffn_hidden_size=shape.ffn, swiglu=shape.swiglu, attention_output_gate=False,
        num_experts=shape.num_experts, moe_router_topk=shape.moe_router_topk,
        moe_layer_freq=parse_moe_layer_freq(freq) if isinstance(freq, str) else freq,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size, moe_latent_size=None,
        moe_shared_expert_intermediate_size=shape.moe_shared_expert_intermediate_size,
        mtp_num_layers=shape.mtp_num_layers,
        multi_latent_attention=shape.multi_latent_attention, q_lora_rank=shape.q_lora_rank,
        kv_lora_rank=shape.kv_lora_rank, qk_head_dim=shape.qk_head_dim,
        qk_pos_emb_head_dim=shape.qk_pos_emb_head_dim, v_head_dim=shape.v_head_dim,
        padded_vocab_size=PADDED_VOCAB,
    )  # fmt: skip


def _megatrons(rank: int, world_size: int, shapes: list[ModelShape]) -> list[float]:
    from megatron.training.training import num_floating_point_operations

    return [float(num_floating_point_operations(_megatron_args(s), SAMPLES)) for s in shapes]


@pytest.mark.skipif(not SHIPS_TRAINING, reason="the megatron-core wheel ships no megatron/training")
def test_ours_is_megatron_lms_count() -> None:
    shapes = [ModelShape(**values) for values in SHAPES.values()]
    (megatrons,) = run_workers(_megatrons, 1, args=(shapes,), timeout_s=120.0)
    ours = [megatron_lm_flops(s, SAMPLES, PADDED_VOCAB) for s in shapes]
    assert ours == pytest.approx(megatrons, rel=1e-12)
    assert len(set(ours)) == 3
