"""``train`` with F&B overlap (``overlap_moe_expert_parallel_comm``): the tiny MoE demo in
bf16 runs with every FB pair overlapped, prints how many, and gives exactly the losses of
the same run without overlap; bad combinations are one sentence before any work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import ConfigError, load_config, train

MOE = Path(__file__).resolve().parents[1] / "configs" / "tiny_moe_cpu.yaml"


def _train(*overrides: str):
    base = ("bf16=true", "eval_interval=5", "output_dir=null")
    return train(load_config(MOE, [*base, *overrides]), source=str(MOE))


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.slow
def test_overlap_keeps_every_loss_of_the_run_without_it() -> None:
    on = _train("overlap_moe_expert_parallel_comm=true")
    off = _train("overlap_moe_expert_parallel_comm=false")
    # bit-identical: the plan runs the same operations per micro-batch, only interleaved
    assert on.losses == off.losses and len(on.losses) == 10
    assert on.validation == off.validation and len(on.validation) == 2
    assert " overlapped FB pairs per step: 6 (of 6 FB actions)" in on.lines
    said = off.lines.index(" overlapped FB pairs per step: 0 (of 6 FB actions)")
    assert off.lines[said + 1] == (
        "   F&B overlap needs overlap_moe_expert_parallel_comm: each FB pair ran as its "
        "forward, then its backward"
    )


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.multiproc
def test_the_overlapped_demo_runs_and_says_so() -> None:
    result = _train("overlap_moe_expert_parallel_comm=true", "train_iters=3", "lr_warmup_iters=1")
    assert " overlapped FB pairs per step: 6 (of 6 FB actions)" in result.lines
    assert len(result.losses) == 3 and all(0 < v < 10 for v in result.losses.values())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("expert_model_parallel_size=1",),
            "needs expert parallelism, as in Megatron-Core: set the expert-model-parallel size to "
            "2 or more",
        ),
        (("bf16=false",), "needs a bf16 (or fp16) model, as in Megatron-Core: turn bf16 on"),
        (
            ("recompute_granularity=full",),
            "needs selective or no activation recomputation (got full), as in Megatron-Core: "
            "unset recompute_granularity",
        ),
        (
            ("moe_token_dispatcher_type=allgather",),
            "needs the alltoall or flex token dispatcher (got 'allgather')",
        ),
        (
            ("pipeline_schedule=1f1b",),
            "needs a schedule with FB pairs to overlap (dualpipe or dualpipev; 1f1b has none)",
        ),
    ],
)
def test_megatrons_preconditions_are_one_sentence(overrides: tuple, message: str) -> None:
    values = ["overlap_moe_expert_parallel_comm=true", "bf16=true", *overrides]
    with pytest.raises(ConfigError) as info:
        load_config(MOE, values)
    text = str(info.value)
    # The key was set by --set: the error names that option.
    blamed = "--set overlap_moe_expert_parallel_comm=true: overlap_moe_expert_parallel_comm: "
    assert text.startswith(blamed) and message in text
    assert "\n" not in text


def test_selective_recomputation_is_taken_with_overlap_as_megatron_takes_it() -> None:
    """Megatron-Core refuses full recomputation with the overlap (above), not selective."""
    values = ["overlap_moe_expert_parallel_comm=true", "bf16=true"]
    cfg = load_config(MOE, [*values, "recompute_granularity=selective"])
    assert cfg.recompute_granularity == "selective" and cfg.overlap_moe_expert_parallel_comm


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["recompute_granularity=full"], "full needs recompute_method (uniform or block)"),
        (["recompute_method=uniform"], "applies to recompute_granularity: full"),
        (["recompute_modules=mlp"], "applies to recompute_granularity: selective"),
        (
            ["recompute_granularity=selective", "recompute_modules=attention"],
            "'attention' is not one of Megatron-Core's",
        ),
        (
            ["recompute_granularity=selective", "recompute_modules=moe_act", "fp8=e4m3"],
            "moe_act and layernorm recomputation with fp8 need a recipe other than "
            "fp8_recipe: delayed",
        ),
    ],
)
def test_recomputation_keys_follow_megatron_cores_rules(overrides: list, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_config(MOE, overrides)
    assert "\n" not in str(info.value)
    assert load_config(MOE, ["recompute_granularity=selective"]).recompute_granularity


def test_the_dense_model_hears_the_whole_condition_at_once() -> None:
    """It was told to set EP >= 2, which then failed with "needs num_experts"."""
    tiny = MOE.parent / "tiny_gpt_cpu.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(tiny, ["overlap_moe_expert_parallel_comm=true"])
    assert str(info.value) == (
        "--set overlap_moe_expert_parallel_comm=true: overlap_moe_expert_parallel_comm: needs a "
        "MoE model, expert parallelism, the alltoall or flex token dispatcher (got 'allgather') "
        "and a bf16 (or fp16) model, as in Megatron-Core: give the model routed experts "
        "(num_experts), set the expert-model-parallel size to 2 or more (the data-parallel "
        "size, world size / (TP x PP), a multiple of it), set the token dispatcher to alltoall "
        "and turn bf16 on, or turn it off"
    )
