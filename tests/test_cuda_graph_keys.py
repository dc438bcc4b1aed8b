"""CUDA-graph flags: ``--cuda-graph-impl``, ``--cuda-graph-modules`` (0.16/0.17:
``--cuda-graph-scope``) and ``--cuda-graph-warmup-steps`` on the Megatron-LM route, each
release's names (``megatron/compat/version.py``), the refusal without CUDA before any work,
and ``local`` allowed only where no graphed part defers its dW."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_dualpipe import megatron_lm
from megatron_dualpipe.megatron.compat.version import (
    cuda_graph_setting,
    installed_megatron_core,
)
from megatron_dualpipe.megatron.schedule.checks import DualPipeConfigError
from megatron_dualpipe.schedules.cuda_graphs import cuda_graph_problem, deferring_modules
from megatron_dualpipe.schedules.registry import spec

pytestmark = pytest.mark.megatron

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "tiny_gpt_cpu.yaml"
MOE = CONFIGS / "tiny_moe_cpu.yaml"
NEW_NAMES = tuple(int(p) for p in installed_megatron_core().split(".")[:2]) >= (0, 18)


def test_the_router_of_a_moe_model_defers_nothing() -> None:
    """``local`` graphs of the router (and the MoE preprocess) leave no dW out; with the
    shared expert in the router's graph, its dW would be: tests/test_megatron_lm.py refuses
    that through the route."""
    modules = ("moe_router", "moe_preprocess")
    assert deferring_modules(modules, shared_expert_in_router_graph=False) == []
    assert deferring_modules(modules, shared_expert_in_router_graph=True) != []


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_local_names_the_scope_and_the_alternatives(schedule: str) -> None:
    problem = cuda_graph_problem(spec(schedule), "local", ("mlp",))
    assert problem == (
        f"cuda_graph_impl local under {schedule} graphs mlp, and mlp defers its weight gradient "
        "to a W that the replayed backward graph cannot leave out: graph only moe_router / "
        "moe_preprocess (without the shared expert, or with moe_shared_expert_overlap), or "
        "choose 1f1b or interleaved-1f1b to graph whole layers"
    )


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_megatrons_schedules_take_every_implementation(schedule: str) -> None:
    for impl in ("local", "transformer_engine", "full_iteration"):
        assert cuda_graph_problem(spec(schedule), impl, ()) is None


def test_the_release_names() -> None:
    """0.18 renamed the scope to modules and made full_iteration an implementation."""
    key = "cuda_graph_modules" if NEW_NAMES else "cuda_graph_scope"
    from megatron.core.transformer.transformer_config import TransformerConfig

    local = {"cuda_graph_impl": "local", key: ["attn"]}
    full = {"cuda_graph_impl": "full_iteration", key: []} if NEW_NAMES else {
        "cuda_graph_impl": "local",
        key: ["full_iteration"],
    }
    for given, setting in ((local, ("local", ("attn",))), (full, ("full_iteration", ()))):
        config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, **given)
        assert cuda_graph_setting(config) == setting
    # Megatron-LM's arguments as each release leaves them.
    assert cuda_graph_setting(argparse.Namespace(cuda_graph_impl="none")) == ("none", ())
    old = argparse.Namespace(cuda_graph_impl="local", **{key: ["full"]})
    assert cuda_graph_setting(old) == ("local", ())


def _lm_args(**overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = dict(
        pipeline_schedule="dualpipev",
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        num_layers=16,
        mtp_num_layers=None,
        micro_batch_size=1,
        global_batch_size=16,
        data_parallel_size=2,
        rampup_batch_size=None,
        untie_embeddings_and_output_weights=True,
        yaml_cfg=None,
        pipeline_model_parallel_layout=None,
        cuda_graph_impl="local",
    )
    values["cuda_graph_modules" if NEW_NAMES else "cuda_graph_scope"] = []
    values.update(overrides)
    return argparse.Namespace(**values)


def test_the_megatron_lm_route_refuses_graphs_without_cuda() -> None:
    with pytest.raises(DualPipeConfigError) as info:
        megatron_lm.apply(_lm_args(pipeline_schedule="1f1b"))
    assert str(info.value) == (
        "--cuda-graph-impl local captures CUDA graphs, and this machine has no CUDA device: "
        "drop --cuda-graph-impl (or set it to none)"
    )
    megatron_lm.apply(_lm_args(cuda_graph_impl="none"))


def test_the_megatron_lm_route_under_our_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a GPU machine (CUDA's presence stood in for inside this test only)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    key = "cuda_graph_modules" if NEW_NAMES else "cuda_graph_scope"
    with pytest.raises(
        DualPipeConfigError,
        match=r"^--cuda-graph-impl local under dualpipev "
        "graphs the whole layer",
    ):
        megatron_lm.apply(_lm_args())
    with pytest.raises(DualPipeConfigError, match="^--cuda-graph-impl transformer_engine under"):
        megatron_lm.apply(_lm_args(cuda_graph_impl="transformer_engine"))
    megatron_lm.apply(_lm_args(**{key: ["moe_router", "moe_preprocess"]}))
    megatron_lm.apply(_lm_args(pipeline_schedule="1f1b", cuda_graph_impl="transformer_engine"))
    shared = _lm_args(**{key: ["moe_router"]}, moe_shared_expert_intermediate_size=64)
    with pytest.raises(DualPipeConfigError, match="moe_router \\(with the shared expert\\)"):
        megatron_lm.apply(shared)
    shared.moe_shared_expert_overlap = True
    megatron_lm.apply(shared)


def test_the_megatron_lm_route_takes_full_iteration_under_dualpipev(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Megatron-LM's train wraps the function it is given in FullCudaGraphWrapper: under
    dualpipev it is ours, graph-safe; dualpipe and variable shapes stay refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = _lm_args(cuda_graph_impl="full_iteration")
    megatron_lm.apply(args)
    func = megatron_lm.forward_backward_func(args, lambda **kw: [])
    assert func.graph_safe
    eager = _lm_args(cuda_graph_impl="none")
    assert not megatron_lm.forward_backward_func(eager, lambda **kw: []).graph_safe
    refused = "^--cuda-graph-impl full_iteration under dualpipe:"
    with pytest.raises(DualPipeConfigError, match=refused):
        megatron_lm.apply(_lm_args(cuda_graph_impl="full_iteration", pipeline_schedule="dualpipe"))
    with pytest.raises(DualPipeConfigError, match="--variable-seq-lengths changes them"):
        megatron_lm.apply(_lm_args(cuda_graph_impl="full_iteration", variable_seq_lengths=True))
