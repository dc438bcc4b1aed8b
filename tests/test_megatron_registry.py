"""Selecting schedules: install() and get_forward_backward_func, and the refusal of bad
configurations with one sentence, before any work."""

from __future__ import annotations

import pytest
from megatron.core import pipeline_parallel
from megatron.core.pipeline_parallel import schedules as megatron_schedules

import megatron_dualpipe
from megatron_dualpipe.megatron.model.placement import (
    StagePlacementLayout,
    chunk_roles,
    config_chunk_roles,
)
from megatron_dualpipe.megatron.schedule import registry
from megatron_dualpipe.megatron.schedule.checks import (
    DualPipeConfigError,
    check_run,
    pipeline_setup,
    schedule_spec,
)
from megatron_dualpipe.megatron.schedule.forward_backward import DualPipeForwardBackward
from tests.tiny_models import tiny_gpt_config

pytestmark = pytest.mark.megatron


@pytest.fixture(autouse=True)
def _nothing_installed():
    megatron_dualpipe.uninstall()
    yield
    megatron_dualpipe.uninstall()


def test_install_patches_every_import_site_and_can_be_undone() -> None:
    original = megatron_schedules.get_forward_backward_func
    installation = megatron_dualpipe.install("dualpipev")
    ours = installation.forward_backward
    assert isinstance(ours, DualPipeForwardBackward) and ours.schedule_name == "dualpipev"
    # Every call site gets the one object of the run (its executor is reused every step).
    assert pipeline_parallel.get_forward_backward_func() is ours
    assert megatron_schedules.get_forward_backward_func(2, None) is ours
    installation.undo()
    assert pipeline_parallel.get_forward_backward_func is original
    assert megatron_schedules.get_forward_backward_func is original


def test_install_again_replaces_and_uninstall_restores() -> None:
    original = megatron_schedules.get_forward_backward_func
    with megatron_dualpipe.install("zb1p"):
        second = megatron_dualpipe.install("dualpipe").forward_backward
        assert megatron_schedules.get_forward_backward_func() is second
        megatron_dualpipe.uninstall()
        assert megatron_schedules.get_forward_backward_func is original
    assert megatron_schedules.get_forward_backward_func is original


def test_installing_megatrons_schedule_keeps_megatrons_choice() -> None:
    with megatron_dualpipe.install("1f1b") as installation:
        assert installation.forward_backward is None
        assert megatron_schedules.get_forward_backward_func(2, None) is (
            megatron_schedules.forward_backward_pipelining_without_interleaving
        )


@pytest.mark.parametrize("name", ["zb1p", "dualpipe", "dualpipev"])
def test_our_schedules_are_selected_by_name(name: str) -> None:
    func = registry.get_forward_backward_func(pipeline_schedule=name, timeout_s=12.5)
    assert isinstance(func, DualPipeForwardBackward)
    assert (func.schedule_name, func.timeout_s) == (name, 12.5)
    assert func is not registry.get_forward_backward_func(pipeline_schedule=name)


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
        ("dualpipev", dict(pipeline_size=4, num_microbatches=6), ">= 2 x PP = 8, got 6"),
        ("dualpipe", dict(pipeline_size=4, num_microbatches=9), "and even, got 9"),
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
        check_run(schedule_spec(schedule), **kwargs)


def test_layers_must_split_into_stages() -> None:
    with pytest.raises(DualPipeConfigError, match="6 layers do not split evenly into 8 stages"):
        pipeline_setup("dualpipev", 4, 6)
    with pytest.raises(DualPipeConfigError, match="give 4 per-stage layer counts >= 0, got"):
        pipeline_setup("dualpipev", 2, (2, 2, 4))
    assert [r.num_layers for r in chunk_roles(pipeline_setup("dualpipe", 2, 6), 0)] == [3, 3]


def test_a_model_built_for_another_placement_is_refused() -> None:
    layout = StagePlacementLayout(pipeline_setup("dualpipev", 2, 8))
    config = tiny_gpt_config(num_layers=8, pipeline_model_parallel_layout=layout)
    v, mirror = pipeline_setup("dualpipev", 2), pipeline_setup("dualpipe", 2)
    assert [r.layer_offset for r in config_chunk_roles(config, v, 1)] == [2, 4]
    with pytest.raises(DualPipeConfigError, match="built for dualpipev at PP=2 but runs dualpipe"):
        config_chunk_roles(config, mirror, 0)
    plain = tiny_gpt_config(num_layers=8, pipeline_model_parallel_size=2)
    with pytest.raises(DualPipeConfigError, match="pipeline_model_parallel_layout to be"):
        config_chunk_roles(plain, v, 0)
    # zb1p: Megatron's own split, here its first/last counts.
    uneven = tiny_gpt_config(
        num_layers=8, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=3
    )
    assert [r.num_layers for r in config_chunk_roles(uneven, pipeline_setup("zb1p", 2), 1)] == [5]


def test_v_placement_keeps_global_layer_numbers() -> None:
    setup = pipeline_setup("dualpipev", 2, 8)
    roles = [chunk_roles(setup, rank) for rank in range(2)]
    assert [(r.layer_offset, r.num_layers) for r in roles[0]] == [(0, 2), (6, 2)]
    assert [(r.layer_offset, r.num_layers) for r in roles[1]] == [(2, 2), (4, 2)]
    assert roles[0][0].pre_process and roles[0][1].post_process
    assert not any(r.pre_process or r.post_process for r in roles[1])
    layout = StagePlacementLayout(setup)
    assert layout.get_layer_offset(vp_stage=1, pp_rank=0) == 6
    assert layout.get_num_layers_to_build(vp_stage=0, pp_rank=1) == 2


def test_mirror_placement_holds_two_copies() -> None:
    setup = pipeline_setup("dualpipe", 4, 8)
    roles = [chunk_roles(setup, rank) for rank in range(4)]
    assert [r.model_stage for r in roles[0]] == [0, 3]
    assert [r.model_stage for r in roles[3]] == [3, 0]
    assert roles[3][1].pre_process and roles[3][0].post_process
