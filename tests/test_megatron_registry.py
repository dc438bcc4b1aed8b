"""Selecting schedules: install() and get_forward_backward_func, and the refusal of bad
configurations with one sentence, before any work."""

from __future__ import annotations

import pytest
from megatron.core import pipeline_parallel
from megatron.core.pipeline_parallel import schedules as megatron_schedules

import megatron_dualpipe
from megatron_dualpipe.megatron import registry
from megatron_dualpipe.megatron.checks import DualPipeConfigError, check_run
from megatron_dualpipe.megatron.placement import StagePlacementLayout, chunk_roles
from megatron_dualpipe.megatron.tiny_models import tiny_gpt_config


@pytest.fixture(autouse=True)
def _no_recorded_schedule():
    registry.set_pipeline_schedule(None)
    yield
    registry.set_pipeline_schedule(None)


def test_install_patches_every_import_site_and_is_idempotent() -> None:
    megatron_dualpipe.install()
    megatron_dualpipe.install()
    assert pipeline_parallel.get_forward_backward_func is registry.get_forward_backward_func
    assert megatron_schedules.get_forward_backward_func is registry.get_forward_backward_func


@pytest.mark.parametrize("name", ["zb1p", "dualpipe", "dualpipev"])
def test_our_schedules_are_selected_by_name(name: str) -> None:
    func = registry.get_forward_backward_func(pipeline_schedule=name)
    assert func.args == (name,)
    megatron_dualpipe.install(name)
    assert registry.get_forward_backward_func(2, None).args == (name,)


def test_megatron_schedules_stay_megatrons() -> None:
    func = registry.get_forward_backward_func(2, None, pipeline_schedule="1f1b")
    assert func is megatron_schedules.forward_backward_pipelining_without_interleaving
    func = registry.get_forward_backward_func(2, 2, pipeline_schedule="interleaved-1f1b")
    assert func is megatron_schedules.forward_backward_pipelining_with_interleaving
    assert registry.get_forward_backward_func(1, None) is (
        megatron_schedules.forward_backward_no_pipelining
    )


def test_unknown_schedule_is_one_sentence() -> None:
    with pytest.raises(DualPipeConfigError, match="unknown pipeline schedule 'dualpip'"):
        megatron_dualpipe.install("dualpip")


@pytest.mark.parametrize(
    ("schedule", "kwargs", "message"),
    [
        ("dualpipe", dict(pipeline_size=3, num_microbatches=12), "even number of pipeline ranks"),
        ("dualpipev", dict(pipeline_size=4, num_microbatches=6), "at least 2 x PP = 8"),
        ("dualpipe", dict(pipeline_size=4, num_microbatches=9), "even number of micro-batches"),
        (
            "dualpipev",
            dict(pipeline_size=1, num_microbatches=8),
            "pipeline-model-parallel-size >= 2",
        ),
        (
            "dualpipev",
            dict(pipeline_size=2, num_microbatches=8, virtual_pipeline_size=2),
            "unset --num-layers-per-virtual-pipeline-stage",
        ),
        (
            "zb1p",
            dict(pipeline_size=2, num_microbatches=8, context_parallel_size=2),
            "context parallelism",
        ),
    ],
)
def test_bad_combinations_fail_before_work(schedule: str, kwargs: dict, message: str) -> None:
    with pytest.raises(DualPipeConfigError, match=message):
        check_run(schedule, **kwargs)


def test_layers_must_split_into_stages() -> None:
    config = tiny_gpt_config(num_layers=6)
    with pytest.raises(DualPipeConfigError, match="--num-layers 6 is not divisible by 8"):
        check_run("dualpipev", pipeline_size=4, num_microbatches=8, config=config)
    check_run("dualpipe", pipeline_size=2, num_microbatches=4, config=tiny_gpt_config(num_layers=6))


def test_v_placement_keeps_global_layer_numbers() -> None:
    roles = [chunk_roles("dualpipev", 2, rank, 8) for rank in range(2)]
    assert [(r.layer_offset, r.num_layers) for r in roles[0]] == [(0, 2), (6, 2)]
    assert [(r.layer_offset, r.num_layers) for r in roles[1]] == [(2, 2), (4, 2)]
    assert roles[0][0].pre_process and roles[0][1].post_process
    assert not any(r.pre_process or r.post_process for r in roles[1])
    layout = StagePlacementLayout("dualpipev", 2, 8)
    assert layout.get_layer_offset(vp_stage=1, pp_rank=0) == 6
    assert layout.get_num_layers_to_build(vp_stage=0, pp_rank=1) == 2


def test_mirror_placement_holds_two_copies() -> None:
    roles = [chunk_roles("dualpipe", 4, rank, 8) for rank in range(4)]
    assert [r.model_stage for r in roles[0]] == [0, 3]
    assert [r.model_stage for r in roles[3]] == [3, 0]
    assert roles[3][1].pre_process and roles[3][0].post_process
