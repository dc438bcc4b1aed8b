"""CUDA-graph keys and flags: ``cuda_graph_impl``, ``cuda_graph_modules`` (0.16/0.17:
``cuda_graph_scope``) and ``cuda_graph_warmup_steps`` in ``train``'s config and on the
Megatron-LM route, each release's names (``megatron/compat/version.py``), the refusal without
CUDA before any work, and ``local`` allowed only where no graphed part defers its dW."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_dualpipe import megatron_lm
from megatron_dualpipe.megatron.compat.version import (
    cuda_graph_config,
    cuda_graph_setting,
    installed_megatron_core,
)
from megatron_dualpipe.megatron.schedule.checks import DualPipeConfigError
from megatron_dualpipe.megatron.training import ConfigError, launch, load_config
from megatron_dualpipe.schedules.cuda_graphs import cuda_graph_problem, deferring_modules

pytestmark = pytest.mark.megatron

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "tiny_gpt_cpu.yaml"
MOE = CONFIGS / "tiny_moe_cpu.yaml"
NEW_NAMES = tuple(int(p) for p in installed_megatron_core().split(".")[:2]) >= (0, 18)


def _error(path: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_keys_default_to_no_graphs() -> None:
    cfg = load_config(TINY)
    assert (cfg.cuda_graph_impl, cfg.cuda_graph_module_names) == ("none", ())
    assert cfg.cuda_graph_warmup_steps == 3
    assert cuda_graph_config("none", (), 3) == {}


def test_local_under_1f1b_is_read_with_either_name() -> None:
    for key in ("cuda_graph_modules", "cuda_graph_scope"):
        cfg = load_config(
            TINY,
            [
                "pipeline_schedule=1f1b",
                "cuda_graph_impl=local",
                f"{key}=attn mlp",
                "cuda_graph_warmup_steps=0",
            ],
        )
        assert cfg.cuda_graph_module_names == ("attn", "mlp")
        assert cfg.cuda_graph_warmup_steps == 0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["cuda_graph_impl=eager"],
            "cuda_graph_impl: 'eager' is not one of none, local, "
            "transformer_engine, full_iteration",
        ),
        (
            ["cuda_graph_modules=attn", "cuda_graph_scope=attn"],
            "cuda_graph_scope: is megatron-core 0.16/0.17's name of cuda_graph_modules, which is "
            "set too: keep one",
        ),
        (
            ["pipeline_schedule=1f1b", "cuda_graph_impl=local", "cuda_graph_scope=full_iteration"],
            "cuda_graph_scope: full_iteration is an implementation in megatron-core 0.18's names",
        ),
        (
            ["pipeline_schedule=1f1b", "cuda_graph_impl=local", "cuda_graph_modules=attention"],
            "cuda_graph_modules: 'attention' is not one of attn, mlp, moe",
        ),
        (["cuda_graph_warmup_steps=-1"], "cuda_graph_warmup_steps: must be >= 0, got -1"),
        (
            ["cuda_graph_impl=local"],
            "cuda_graph_impl: local under dualpipev graphs the whole layer, and "
            "the whole layer defers its weight gradient",
        ),
        (
            ["cuda_graph_impl=local", "cuda_graph_modules=attn moe_router"],
            "cuda_graph_impl: local under dualpipev graphs attn moe_router, and attn defers",
        ),
        (
            ["cuda_graph_impl=transformer_engine"],
            "cuda_graph_impl: transformer_engine under dualpipev graphs the whole layer, and "
            "the whole layer defers its weight gradient to a W that TE graphs apart for a "
            "chunk's latest backward only",
        ),
        (
            ["pipeline_schedule=dualpipe", "cuda_graph_impl=full_iteration"],
            "cuda_graph_impl: full_iteration under dualpipe: FullCudaGraphWrapper reads every "
            "micro-batch of the step for each of a rank's model chunks",
        ),
        (
            ["pipeline_schedule=1f1b", "cuda_graph_impl=full_iteration"],
            "(FullCudaGraphWrapper), which train does not run",
        ),
        (
            [
                "pipeline_schedule=1f1b",
                "cuda_graph_impl=transformer_engine",
                "transformer_impl=local",
            ],
            "cuda_graph_impl: transformer_engine graphing the whole layer with transformer_impl: "
            "local replays attention without its causal mask",
        ),
    ],
)
def test_each_graph_mistake_is_one_sentence(overrides: list[str], expected: str) -> None:
    assert expected in _error(TINY, *overrides)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["optimize_schedule=true"],
            "optimize_schedule: reorders the step after it measures one, and TE's graphs under "
            "cuda_graph_impl: transformer_engine replay in the order they were captured in",
        ),
        (
            ["overlap_moe_expert_parallel_comm=true", "bf16=true"],
            "overlap_moe_expert_parallel_comm: under cuda_graph_impl: transformer_engine has "
            "Megatron graph each layer in its combined 1F1B order, which dualpipev does not run",
        ),
    ],
)
def test_transformer_engine_under_ours_refuses_what_reorders_its_graphs(
    overrides: list[str], expected: str
) -> None:
    te = ["cuda_graph_impl=transformer_engine", "cuda_graph_modules=moe_router"]
    assert expected in _error(MOE, *te, *overrides)


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_train_takes_transformer_engine_where_te_can_graph(schedule: str) -> None:
    """``train`` runs TE's per-layer graphs (``layer_graphs``): the whole layer under
    Megatron's schedules, the router under ours."""
    modules = "" if schedule == "1f1b" else "moe_router"
    cfg = load_config(
        MOE,
        [
            f"pipeline_schedule={schedule}",
            "cuda_graph_impl=transformer_engine",
            f"cuda_graph_modules={modules}",
        ],
    )
    assert cfg.cuda_graph_impl == "transformer_engine"


def test_local_on_the_router_of_a_moe_model_defers_nothing() -> None:
    cfg = load_config(
        MOE, ["cuda_graph_impl=local", "cuda_graph_modules=moe_router moe_preprocess"]
    )
    assert cfg.pipeline_schedule == "dualpipev"
    assert deferring_modules(cfg.cuda_graph_module_names, shared_expert_in_router_graph=False) == []
    with_shared = _error(
        MOE,
        "cuda_graph_impl=local",
        "cuda_graph_modules=moe_router",
        "moe_shared_expert_intermediate_size=32",
    )
    assert "moe_router (with the shared expert) defers its weight gradient" in with_shared


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_local_names_the_scope_and_the_alternatives(schedule: str) -> None:
    problem = cuda_graph_problem(schedule, "local", ("mlp",))
    assert problem == (
        f"cuda_graph_impl local under {schedule} graphs mlp, and mlp defers its weight gradient "
        "to a W that the replayed backward graph cannot leave out: graph only moe_router / "
        "moe_preprocess (without the shared expert, or with moe_shared_expert_overlap), or "
        "choose 1f1b or interleaved-1f1b to graph whole layers"
    )


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_megatrons_schedules_take_every_implementation(schedule: str) -> None:
    for impl in ("local", "transformer_engine", "full_iteration"):
        assert cuda_graph_problem(schedule, impl, ()) is None


def test_the_cpu_refusal_comes_before_any_process_group() -> None:
    cfg = load_config(TINY, ["pipeline_schedule=1f1b", "cuda_graph_impl=local"])
    assert not torch.cuda.is_available()
    with pytest.raises(ConfigError) as info:
        launch.train(cfg, source="tiny.yaml")
    assert str(info.value) == (
        "tiny.yaml: cuda_graph_impl: local captures CUDA graphs, and this machine has no CUDA "
        "device: set cuda_graph_impl: none here"
    )
    assert not torch.distributed.is_initialized()


def test_the_release_names() -> None:
    """0.18 renamed the scope to modules and made full_iteration an implementation."""
    key = "cuda_graph_modules" if NEW_NAMES else "cuda_graph_scope"
    assert cuda_graph_config("local", ("attn",), 2) == {
        "cuda_graph_impl": "local",
        key: ["attn"],
        "cuda_graph_warmup_steps": 2,
    }
    full = cuda_graph_config("full_iteration", (), 1)
    if NEW_NAMES:
        assert full == {"cuda_graph_impl": "full_iteration", key: [], "cuda_graph_warmup_steps": 1}
    else:
        assert full == {
            "cuda_graph_impl": "local",
            key: ["full_iteration"],
            "cuda_graph_warmup_steps": 1,
        }
    from megatron.core.transformer.transformer_config import TransformerConfig

    for impl, modules in (("local", ("attn",)), ("full_iteration", ())):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=8,
            num_attention_heads=2,
            **cuda_graph_config(impl, modules, 3),
        )
        assert cuda_graph_setting(config) == (impl, modules)
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
