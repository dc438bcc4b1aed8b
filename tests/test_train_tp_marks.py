"""``train`` builds the model with ``perform_initialization`` off (it draws the weights
itself, megatron_dualpipe/megatron/training/model.py), and its tensor-parallel weights
still carry Megatron's marks (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``) exactly where Megatron's own initialising build puts them.

megatron-core before 0.18 sets the marks of ``ColumnParallelLinear``,
``RowParallelLinear`` and ``VocabParallelEmbedding`` weights only while initialising them
(Megatron-LM #4084 sets them either way from 0.18 on). Megatron's gradient norm
(``get_grad_norm_fp32`` through ``param_is_not_tensor_parallel_duplicate``) counts an
unmarked parameter on tensor-parallel rank 0 only, so without the marks the norm, and with
it ``clip_grad``, misses the other ranks' shards.

- Per parameter name, on every pipeline rank, at TP=2: the marks of train's build equal
  those of the same build with ``perform_initialization`` on (dense GPT under 1f1b and
  under dualpipev, whose linears are the deferrable ones; MoE; DeepSeek-style MLA, MoE,
  SwiGLU (the MLP's first linear has stride 2), MTP).
- Megatron's optimizer over train's model at TP=2, every gradient 1: its gradient norm is
  the square root of the model's parameter count, the norm of the same model at TP=1.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import load_config
from tests.multiproc import run_workers

pytestmark = pytest.mark.megatron

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TP2 = ["tensor_model_parallel_size=2"]
BUILDS = {
    "gpt-1f1b": ("tiny_gpt_cpu.yaml", ["pipeline_schedule=1f1b", "world_size=4", *TP2]),
    "gpt-dualpipev": ("tiny_gpt_cpu.yaml", ["world_size=4", *TP2]),
    "moe-dualpipev": ("tiny_moe_cpu.yaml", ["world_size=8", *TP2]),
    "deepseek-dualpipev": ("tiny_deepseek_cpu.yaml", ["world_size=8", *TP2]),
}


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int) -> Iterator[None]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _marks(name: str, pipeline_rank: int, megatron_initialises: bool) -> dict:
    """Each parameter of train's build of pipeline rank ``pipeline_rank`` (on the meta
    device, in a fake world) by global name: its marks, None where it has none."""
    import torch
    from megatron.core import parallel_state

    from megatron_dualpipe.megatron.compat.cpu_compat import apply_cpu_compat
    from megatron_dualpipe.megatron.model.names import global_named_parameters
    from megatron_dualpipe.megatron.training.loop import initialize_parallel_state
    from megatron_dualpipe.megatron.training.model import build_chunks_here, transformer_config

    apply_cpu_compat()
    path, overrides = BUILDS[name]
    cfg = load_config(CONFIGS / path, overrides)
    world = cfg.launch_world_size
    with _fake_world(pipeline_rank * (world // cfg.pipeline_model_parallel_size), world):
        initialize_parallel_state(cfg, gloo_groups=False)
        try:
            assert parallel_state.get_tensor_model_parallel_world_size() == 2
            config = transformer_config(cfg, on_gpu=False)
            config.perform_initialization = megatron_initialises
            with torch.device("meta"):
                chunks, _ = build_chunks_here(cfg, config, initialise=False)
            return {
                key: (p.tensor_model_parallel, p.partition_dim, p.partition_stride)
                if hasattr(p, "tensor_model_parallel")
                else None
                for chunk in chunks
                for key, p in global_named_parameters(chunk).items()
            }
        finally:
            parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("name", list(BUILDS))
def test_train_marks_tensor_parallel_weights_as_megatron_does(name: str) -> None:
    path, overrides = BUILDS[name]
    cfg = load_config(CONFIGS / path, overrides)
    split = {}
    for rank in range(cfg.pipeline_model_parallel_size):
        ours = _marks(name, rank, megatron_initialises=False)
        megatrons = _marks(name, rank, megatron_initialises=True)
        assert sorted(ours) == sorted(megatrons)
        differ = {k: (ours[k], megatrons[k]) for k in ours if ours[k] != megatrons[k]}
        assert not differ, f"pipeline rank {rank}: (train's, Megatron's) marks {differ}"
        split.update({k.rsplit(".", 2)[-2]: m[1:] for k, m in ours.items() if m and m[0]})
    # Megatron's marks themselves: (partition_dim, partition_stride) by layer.
    assert split["word_embeddings"] == (0, 1)
    assert split["linear_proj"] == split["linear_fc2"] == (1, 1)
    assert split["linear_fc1"] == ((0, 2) if cfg.swiglu else (0, 1))


def _norm_of_ones(rank: int, world_size: int, tp: int) -> tuple[float, int]:
    """Megatron's gradient norm over train's model (tiny GPT, 1f1b, PP=1) at ``tp`` with
    every gradient 1, and this rank's parameter count."""
    from megatron.core import parallel_state

    from megatron_dualpipe.megatron.compat.cpu_compat import apply_cpu_compat
    from megatron_dualpipe.megatron.training.loop import initialize_parallel_state
    from megatron_dualpipe.megatron.training.model import build_model, transformer_config
    from megatron_dualpipe.megatron.training.optim import build_optimizer

    apply_cpu_compat()
    cfg = load_config(
        CONFIGS / "tiny_gpt_cpu.yaml",
        [
            "pipeline_schedule=1f1b",
            "pipeline_model_parallel_size=1",
            f"world_size={tp}",
            f"tensor_model_parallel_size={tp}",
        ],
    )
    initialize_parallel_state(cfg)
    try:
        model = build_model(cfg, transformer_config(cfg, on_gpu=False))
        optimizer, _ = build_optimizer(cfg, model)
        for chunk in model:
            for p in chunk.parameters():
                p.main_grad.fill_(1.0)
        optimizer.prepare_grads()
        return float(optimizer.get_grad_norm()), sum(p.numel() for p in model[0].parameters())
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.multiproc
def test_grad_norm_at_tp2_counts_every_shard() -> None:
    ((whole, params),) = run_workers(_norm_of_ones, 1, args=(1,), timeout_s=120)
    assert math.isclose(whole**2, params, rel_tol=1e-6)
    (norm, _), (other, _) = run_workers(_norm_of_ones, 2, args=(2,), timeout_s=120)
    assert norm == other
    assert math.isclose(norm, whole, rel_tol=1e-6), (norm, whole)
