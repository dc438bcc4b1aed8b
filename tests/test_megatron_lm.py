"""The Megatron-LM route: ``--pipeline-schedule`` through ``megatron_dualpipe.megatron_lm``
and the patches ``patches/megatron-lm-<tag>.patch``, one per Megatron-LM tag.

- add_arguments adds the flag in its own group; apply checks the combination before any
  process-group work (one sentence saying what to change); forward_backward_func gives
  Megatron-LM's training loop our function for our schedules, one object per run;
- the model-building, batch and loss-reporting hooks the patch calls behave;
- each patch is a well-formed git patch of its tag that touches exactly the intended files and
  calls only hooks that exist (CI has no Megatron-LM checkout; the megatron/training hunks
  are applied to the installed wheel's copy in tests/test_megatron_lm_loop.py).
"""

from __future__ import annotations

import argparse
import gc
import re
import subprocess
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.core.transformer.enums import LayerType

from megatron_dualpipe import megatron_lm
from megatron_dualpipe.megatron.compat.lm_patch import outside_any_work_tree
from megatron_dualpipe.megatron.compat.version import (
    MEGATRON_LM_TAGS,
    megatron_lm_tag,
    mtp_tracker_fields,
    save_mtp_metrics,
)
from megatron_dualpipe.megatron.model.placement import StagePlacementLayout
from megatron_dualpipe.megatron.schedule.checks import DualPipeConfigError
from megatron_dualpipe.megatron.schedule.forward_backward import DualPipeForwardBackward
from megatron_dualpipe.schedules.limits import MAX_TRAIN_SIZE
from megatron_dualpipe.schedules.registry import SCHEDULES
from tests.multiproc import one_fast, run_workers

pytestmark = pytest.mark.megatron

PATCHES = Path(__file__).resolve().parents[1] / "patches"
#: The files each Megatron-LM tag's patch changes: from core_v0.18 the arguments are validated
#: in arguments.py's parse_and_validate_args, before that in initialize.py.
PATCHED_FILES = {
    tag: {"pretrain_gpt.py", "megatron/training/training.py", f"megatron/training/{validated}"}
    for tag, validated in (
        ("core_v0.16.1", "initialize.py"),
        ("core_v0.17.1", "initialize.py"),
        ("core_v0.18.2", "arguments.py"),
        ("core_v0.19.0", "arguments.py"),
    )
}


def _megatrons(*args: Any, **kwargs: Any) -> list[Any]:
    """Stands for what Megatron's get_forward_backward_func() returned."""
    return []


def _args(**overrides: Any) -> argparse.Namespace:
    """Megatron-LM's validated arguments, as far as apply and the hooks read them."""
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
    )
    values.update(overrides)
    return argparse.Namespace(**values)


# --------------------------------------------------------------------------------------
# add_arguments


def test_add_arguments_adds_the_flag_in_its_own_group() -> None:
    parser = argparse.ArgumentParser()
    assert megatron_lm.add_arguments(parser) is parser  # extra_args_provider contract
    group = next(g for g in parser._action_groups if g.title == "megatron-dualpipe")
    action = next(a for a in group._group_actions if a.dest == "pipeline_schedule")
    assert action.option_strings == ["--pipeline-schedule"]
    assert tuple(action.choices) == megatron_lm.PIPELINE_SCHEDULES
    assert all(name in action.help for name in megatron_lm.PIPELINE_SCHEDULES)
    assert parser.parse_args([]).pipeline_schedule is None
    for name in megatron_lm.PIPELINE_SCHEDULES:
        assert parser.parse_args(["--pipeline-schedule", name]).pipeline_schedule == name


def test_add_arguments_refuses_an_unknown_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    parser = megatron_lm.add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--pipeline-schedule", "dualpipx"])
    assert "invalid choice: 'dualpipx'" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# apply


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_a_good_combination_runs_our_function_one_object_per_run(schedule: str) -> None:
    args = _args(pipeline_schedule=schedule, distributed_timeout_minutes=2.0)
    megatron_lm.apply(args)
    func = megatron_lm.forward_backward_func(args, _megatrons)
    assert isinstance(func, DualPipeForwardBackward)
    assert (func.schedule_name, func.timeout_s) == (schedule, 120.0)
    assert megatron_lm.forward_backward_func(args, _megatrons) is func
    other_run = _args(pipeline_schedule=schedule)
    assert megatron_lm.forward_backward_func(other_run, _megatrons) is not func


def _optimised_order(tmp_path: Path) -> tuple[str, Any]:
    """A file with an optimised order of dualpipev's work at PP=2 with 8 micro-batches
    (49 units at F=B=W where the generated order takes 50), and that schedule."""
    from megatron_dualpipe.planner.optimize import Effort, optimize
    from megatron_dualpipe.schedules.cost import CostModel
    from megatron_dualpipe.schedules.registry import generate

    result = optimize(generate("dualpipev", 2, 8).placement, CostModel(), time_limit=20,
                      effort=Effort())  # fmt: skip
    assert not result.fell_back
    path = tmp_path / "order.txt"
    path.write_text(result.schedule.to_text(), encoding="utf-8")
    return str(path), result.schedule


def test_a_saved_order_is_what_the_run_executes(tmp_path: Path) -> None:
    """--pipeline-schedule-file: the saved order, checked in apply(), replaces the generated
    one in the run's forward-backward function."""
    from megatron_dualpipe.schedules.ir import Schedule
    from megatron_dualpipe.schedules.registry import generate

    path, saved = _optimised_order(tmp_path)
    args = _args(pipeline_model_parallel_size=2, data_parallel_size=2,
                 pipeline_schedule_file=path)  # fmt: skip
    megatron_lm.apply(args)
    func = megatron_lm.forward_backward_func(args, _megatrons)
    read = Schedule.from_text(Path(path).read_text(encoding="utf-8")).compute_only()
    assert func.schedule == read != generate("dualpipev", 2, 8).compute_only()
    assert read.ranks == saved.compute_only().ranks


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(pipeline_schedule="1f1b"),
            "--pipeline-schedule-file runs a saved order of the work of the schedules "
            "megatron-dualpipe runs (zb1p, dualpipe, dualpipev), not Megatron's 1f1b: set "
            "--pipeline-schedule to one of them",
        ),
        (
            dict(pipeline_model_parallel_size=4),
            "--pipeline-schedule-file: {path} holds a schedule of the v placement for PP=2 with "
            "4 stages and 8 micro-batches, but this dualpipev run has the v placement for PP=4 "
            "with 8 stages and 8 micro-batches: save a schedule for this run (simulate "
            "--schedule dualpipev --pp 4 --microbatches 8 --optimize --save FILE)",
        ),
        (
            dict(pipeline_schedule=None),
            "--pipeline-schedule-file runs a saved order of the work: give that schedule "
            "with --pipeline-schedule",
        ),
    ],
)
def test_a_saved_order_that_cannot_run_is_one_sentence(
    tmp_path: Path, overrides: dict, message: str
) -> None:
    from megatron_dualpipe.schedules.registry import generate

    path = tmp_path / "order.txt"
    path.write_text(generate("dualpipev", 2, 8).to_text(), encoding="utf-8")
    values = dict(pipeline_model_parallel_size=2, data_parallel_size=2,
                  pipeline_schedule_file=str(path))  # fmt: skip
    with pytest.raises(DualPipeConfigError) as refused:
        megatron_lm.apply(_args(**{**values, **overrides}))
    assert str(refused.value) == message.format(path=path)


def test_a_step_that_ran_other_work_than_generated_is_refused_on_every_rank() -> None:
    """One rank's step did not follow the generated order: every rank raises its sentence
    (an all-gather first), none waits in the gather for a rank that gave up."""
    with pytest.raises(AssertionError) as failed:
        run_workers(_measure_megatron_like, 2, args=(1,), timeout_s=60)
    said = "pipeline rank 1: 1f1b ran more BW actions than the generated schedule has"
    assert "2 of 2 ranks failed" in str(failed.value)
    assert str(failed.value).count(said) >= 2, str(failed.value)


def test_the_launcher_names_a_flag_of_ours_given_without_a_schedule() -> None:
    """What the launcher refuses before any rank (and apply() in each rank, which the
    patch now calls whenever our arguments are there)."""
    assert megatron_lm.unscheduled_flag(_args(pipeline_schedule=None)) is None
    assert megatron_lm.unscheduled_flag(_args(pipeline_timeline="t.png")) is None
    assert megatron_lm.unscheduled_flag(
        _args(pipeline_schedule=None, pipeline_timeline="t.png")
    ) == ("pipeline_timeline", "measures a training step")


def test_a_timeline_without_a_schedule_is_one_sentence() -> None:
    with pytest.raises(DualPipeConfigError) as refused:
        megatron_lm.apply(_args(pipeline_timeline="t.png", pipeline_schedule=None))
    assert str(refused.value) == (
        "--pipeline-timeline measures a training step: give that schedule with "
        "--pipeline-schedule"
    )


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_a_timeline_wraps_the_run_s_function_ours_or_megatron_s(schedule: str) -> None:
    """--pipeline-timeline: the run's function (ours, or Megatron's that the run's first call
    brings) measuring its second training step; nothing measured before the run, and
    nothing asked of a run without the flag."""
    from megatron_dualpipe.megatron.schedule.step_recorder import MeasuredForwardBackward

    args = _args(pipeline_schedule=schedule, pipeline_timeline="t.png")
    megatron_lm.apply(args)
    func = megatron_lm.forward_backward_func(args, _megatrons)
    assert isinstance(func, MeasuredForwardBackward) and func.schedule.name == schedule
    assert megatron_lm.forward_backward_func(args, _megatrons) is func
    inner = DualPipeForwardBackward if schedule == "dualpipev" else type(_megatrons)
    assert isinstance(func.inner, inner)
    assert megatron_lm.measured_step(args) == megatron_lm.MeasuredStep(None, None, "t.png")
    assert megatron_lm.measured_step(_args()) is None
    gone = weakref.ref(func)
    del args, func
    gc.collect()
    assert gone() is None  # the run's function goes with its arguments


def _measure_megatron_like(
    rank: int, world_size: int, extra_on: int | None = None
) -> tuple[float | None, int | None, bool]:
    """An evaluation and three training calls of a function that times its F and BW as
    Megatron's 1F1B does (``config.timers``' forward-compute and backward-compute), measured
    by a MeasuredForwardBackward on a pipeline of two ranks; the iteration is the number of
    training calls so far. Rank ``extra_on`` runs one BW more than the generated order."""
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from megatron_dualpipe.megatron.schedule.step_recorder import MeasuredForwardBackward
    from megatron_dualpipe.schedules.ir import Kind
    from megatron_dualpipe.schedules.registry import generate

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    try:
        order = [a for a in generate("1f1b", 2, 4).ranks[rank] if a.kind in (Kind.F, Kind.BW)]
        order += [order[-1]] * (rank == extra_on)
        chunk = torch.nn.Linear(1, 1)
        chunk.config = SimpleNamespace(timers=None)

        training_calls = []

        def megatron_like(*, forward_step_func, data_iterator, model, forward_only, **_: Any):
            training_calls.extend([None] * (not forward_only))
            config = model[0].config
            for action in order:
                if action.kind is Kind.F:
                    forward_step_func(data_iterator, model[0])
                name = "forward-compute" if action.kind is Kind.F else "backward-compute"
                if config.timers is not None:  # as Megatron's schedules ask
                    config.timers(name, log_level=2).start()
                    config.timers(name).stop()
            return []

        measured = MeasuredForwardBackward(
            megatron_like, SCHEDULES["1f1b"], iteration=lambda: len(training_calls)
        )
        step = dict(forward_step_func=lambda it, m: None, data_iterator=None, model=[chunk],
                    num_microbatches=4)  # fmt: skip
        measured(**step, forward_only=True)  # an evaluation: passes
        for _ in range(3):
            measured(**step, forward_only=False)
        makespan = None if measured.measured is None else measured.measured.makespan
        return makespan, measured.measured_iteration, chunk.config.timers is None
    finally:
        parallel_state.destroy_model_parallel()


def test_the_second_training_step_is_measured_on_the_pipeline_s_first_rank() -> None:
    """The first training step passes (it warms up), the second is recorded through
    Megatron's timers and gathered on rank 0 of the pipeline (a collective both ranks
    enter), the third runs unrecorded; the config's timers are given back."""
    (makespan, iteration, restored), other = run_workers(_measure_megatron_like, 2)
    assert makespan is not None and makespan > 0 and iteration == 2 and restored
    assert other == (None, 2, True)


def test_apply_without_the_argument_does_nothing() -> None:
    megatron_lm.apply(argparse.Namespace(num_layers=3))
    args = _args(pipeline_schedule=None)
    megatron_lm.apply(args)
    assert megatron_lm.forward_backward_func(args, _megatrons) is _megatrons


@pytest.mark.parametrize(
    "overrides",
    [
        dict(mtp_num_layers=1),
        dict(untie_embeddings_and_output_weights=False),
        dict(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=3),
        dict(pipeline_schedule="dualpipe", pipeline_model_parallel_layout="Et|ttttt|ttttt|tttttL"),
    ],
)
def test_mtp_tied_embeddings_and_uneven_stages_are_accepted(overrides: dict[str, Any]) -> None:
    megatron_lm.apply(_args(**overrides))


def test_megatrons_own_1f1b_keeps_megatrons_function() -> None:
    args = _args(pipeline_schedule="1f1b")
    megatron_lm.apply(args)
    assert megatron_lm.forward_backward_func(args, _megatrons) is _megatrons


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(global_batch_size=12), "micro-batches to be >= 2 x PP = 8, got 6"),
        (dict(num_layers=12), "dualpipev at PP=4 runs 8 model stages: 12 layers do not split"),
        (
            dict(num_layers=16, decoder_first_pipeline_num_layers=3),
            "after 3 layers in the first/last stage, 13 layers do not split evenly",
        ),
        (
            dict(
                pipeline_schedule="dualpipe",
                pipeline_model_parallel_size=3,
                num_layers=6,
                global_batch_size=24,
            ),
            "even number of pipeline ranks",
        ),
        (dict(pipeline_model_parallel_size=1), "needs --pipeline-model-parallel-size >= 2"),
        (dict(virtual_pipeline_model_parallel_size=2), "places its own model chunks"),
        (dict(context_parallel_size=2), "--context-parallel-size 1"),
        (dict(rampup_batch_size=["4", "4", "100"]), "unset --rampup-batch-size"),
        (dict(yaml_cfg="model.yaml"), "drop --yaml-cfg"),
        (
            dict(pipeline_model_parallel_layout="Etttt|tttt|tttt|ttttL"),
            "dualpipev runs 8 model stages on 4 ranks and --pipeline-model-parallel-layout has "
            "4: give one entry per model stage, in pipeline order",
        ),
        (
            dict(
                pipeline_schedule="dualpipe",
                pipeline_model_parallel_layout="Ettt|tttt|tttt|ttttL",
            ),
            "holds 15 decoder layers (t) but num_layers is 16",
        ),
        (
            dict(pipeline_schedule="1f1b", virtual_pipeline_model_parallel_size=2),
            "1f1b runs one model chunk per rank",
        ),
        (dict(pipeline_schedule="interleaved-1f1b"), "interleaved-1f1b needs pipeline parallelism"),
        (
            dict(
                overlap_moe_expert_parallel_comm=True,
                num_experts=4,
                expert_model_parallel_size=1,
                moe_token_dispatcher_type="alltoall",
                bf16=True,
            ),
            "--overlap-moe-expert-parallel-comm needs expert parallelism",
        ),
        (
            dict(pipeline_schedule="dualpipe", use_megatron_fsdp=True),
            "which --use-megatron-fsdp shards: drop it, or choose dualpipev",
        ),
        (
            dict(pipeline_schedule="zb1p", use_torch_fsdp2=True),
            "through Megatron DDP's hooks (delay_wgrad_compute), which --use-torch-fsdp2 does "
            "not take",
        ),
        (
            dict(pipeline_schedule="zb1p", use_megatron_fsdp=True),
            "which --use-megatron-fsdp does not take: drop it, or choose 1f1b",
        ),
        (
            dict(pipeline_schedule="dualpipe", overlap_grad_reduce=True, ddp_bucket_size=10**6),
            "needs one DDP bucket per model chunk",
        ),
        (
            dict(
                overlap_moe_expert_parallel_comm=True,
                num_experts=4,
                expert_model_parallel_size=2,
                moe_token_dispatcher_type="alltoall",
            ),
            "--overlap-moe-expert-parallel-comm needs a bf16 (or fp16) model",
        ),
    ],
)
def test_apply_refuses_a_bad_combination_in_one_sentence(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(DualPipeConfigError) as err:
        megatron_lm.apply(_args(**overrides))
    text = str(err.value)
    assert message in text
    assert "\n" not in text


def test_apply_refuses_a_step_too_large_to_build_before_any_work() -> None:
    """``--global-batch-size 1000000000`` grew each rank by 18 MB/s until it was killed
    (2,000,000 at PP=2, the bound before, ran away too); at the bound the step builds."""
    bound = MAX_TRAIN_SIZE // 4  # PP=4 x micro-batches, data-parallel size 2
    megatron_lm.apply(_args(global_batch_size=2 * bound))
    with pytest.raises(DualPipeConfigError) as err:
        megatron_lm.apply(_args(global_batch_size=1_000_000_000))
    assert str(err.value) == (
        "--global-batch-size 1000000000 makes 500000000 micro-batches per step "
        "(--global-batch-size / (--micro-batch-size x data-parallel size)), and PP=4 x "
        "500000000 micro-batches is too large a step to build on each rank (about 5960.5 GB "
        "and 200000 s before the first step, at 3.2 KB and 0.1 ms per PP x micro-batch): train "
        f"builds PP x micro-batches up to {MAX_TRAIN_SIZE:,} (about 1 GB and 30 s): lower "
        "--global-batch-size or raise --micro-batch-size"
    )
    with pytest.raises(DualPipeConfigError, match="PP=4 x 75001 micro-batches is too large"):
        megatron_lm.apply(_args(global_batch_size=2 * (bound + 1)))
    timed = _args(pipeline_schedule="1f1b", pipeline_timeline="t.png")  # built to be timed
    megatron_lm.apply(timed)
    timed.global_batch_size = 1_000_000_000
    with pytest.raises(DualPipeConfigError, match="PP=4 x 500000000 micro-batches is too"):
        megatron_lm.apply(timed)


def test_apply_refuses_te_graphs_under_ep_overlap_before_the_warm_up() -> None:
    """TE's per-layer graphs with the all-to-all overlap: Megatron would capture them in
    its combined 1F1B order after the warm-up steps; refused at start, before the check
    for a CUDA device (which this machine then fails)."""
    graphs = dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router"])
    graphs["cuda_graph_scope"] = graphs["cuda_graph_modules"]  # megatron-core 0.16/0.17
    with pytest.raises(DualPipeConfigError) as err:
        megatron_lm.apply(_args(**graphs, overlap_moe_expert_parallel_comm=True))
    assert str(err.value) == (
        "--overlap-moe-expert-parallel-comm under --cuda-graph-impl transformer_engine has "
        "Megatron graph each layer in its combined 1F1B order, which dualpipev does not run: "
        "turn one of them off"
    )
    with pytest.raises(DualPipeConfigError, match="this machine has no CUDA device"):
        megatron_lm.apply(_args(**graphs))  # the graphs alone pass the schedule's checks


def test_apply_takes_a_layout_of_the_vs_stages_megatron_read_as_a_virtual_pipeline() -> None:
    """dualpipev at PP=4 has 8 model stages; Megatron-LM's validate_args made a layout of 8
    stages a virtual pipeline of 2: apply unsets it (our placement gives the two chunks),
    and the split is the layout's, read over the V's stages in pipeline order."""
    layout = "Et|tt|ttt|tt|tt|tt|tt|ttL"
    args = _args(pipeline_model_parallel_layout=layout, virtual_pipeline_model_parallel_size=2)
    megatron_lm.apply(args)
    assert args.virtual_pipeline_model_parallel_size is None
    assert megatron_lm._setup(args).stage_layers == (1, 2, 3, 2, 2, 2, 2, 2)


def test_apply_asks_get_model_for_one_bucket_per_chunk_under_dualpipe() -> None:
    """dualpipe's two copies of a stage must be bucketed alike (see prepare_mirrors)."""
    args = _args(pipeline_schedule="dualpipe", overlap_grad_reduce=True)
    megatron_lm.apply(args)
    assert args.ddp_num_buckets == 1
    untouched = _args(overlap_grad_reduce=True)  # dualpipev: one copy of each stage
    megatron_lm.apply(untouched)
    assert not hasattr(untouched, "ddp_num_buckets")


def test_apply_can_exit_with_the_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        megatron_lm.apply(_args(global_batch_size=4), exit_on_error=True)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: dualpipev needs the micro-batches to be >= 2 x PP = 8")
    assert err.count("\n") == 1


# --------------------------------------------------------------------------------------
# The hooks the patch calls


class _Chunk(torch.nn.Module):
    """Stands for what the model provider builds (a module without parameters)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.kwargs = kwargs


def test_build_model_chunks_places_the_v() -> None:
    args = _args(pipeline_model_parallel_size=2, num_layers=8, global_batch_size=8)
    seen: list[argparse.Namespace] = []

    def config_from_args(a: argparse.Namespace) -> argparse.Namespace:
        seen.append(a)
        return argparse.Namespace(pipeline_model_parallel_layout=a.pipeline_model_parallel_layout)

    chunks = megatron_lm.build_model_chunks(
        _Chunk, args, config_from_args, pp_rank=0, pg_collection="pgs"
    )
    assert [(c.kwargs["pre_process"], c.kwargs["post_process"]) for c in chunks] == [
        (True, False),
        (False, True),
    ]
    assert [c.kwargs["vp_stage"] for c in chunks] == [c.vp_stage for c in chunks] == [0, 1]
    assert all(c.kwargs["pg_collection"] == "pgs" for c in chunks)
    layout = chunks[0].kwargs["config"].pipeline_model_parallel_layout
    assert isinstance(layout, StagePlacementLayout)
    # rank 0 holds layers 0-1 (chunk 0) and 6-7 (chunk 1) of 8
    assert [layout.get_layer_offset(vp_stage=c, pp_rank=0) for c in (0, 1)] == [0, 6]
    assert len(seen) == 1 and args.pipeline_model_parallel_layout is None  # args untouched
    middle = megatron_lm.build_model_chunks(_Chunk, args, config_from_args, pp_rank=1)
    assert [(c.kwargs["pre_process"], c.kwargs["post_process"]) for c in middle] == [
        (False, False),
        (False, False),
    ]


def test_build_model_chunks_splits_as_the_arguments_say() -> None:
    args = _args(
        pipeline_model_parallel_size=2,
        num_layers=7,
        global_batch_size=8,
        decoder_first_pipeline_num_layers=1,
        decoder_last_pipeline_num_layers=2,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
        mtp_num_layers=1,
    )
    seen: list[argparse.Namespace] = []

    def config_from_args(a: argparse.Namespace) -> argparse.Namespace:
        seen.append(a)
        return argparse.Namespace(pipeline_model_parallel_layout=a.pipeline_model_parallel_layout)

    chunks = megatron_lm.build_model_chunks(_Chunk, args, config_from_args, pp_rank=0)
    layout = chunks[0].kwargs["config"].pipeline_model_parallel_layout
    assert layout.setup.stage_layers == (1, 2, 2, 2)  # 2 x PP = 4 stages in the V
    # rank 0: stage 0 (layer 0) and stage 3 (layers 5-6, the MTP layer and the loss)
    assert [layout.get_layer_offset(vp_stage=c, pp_rank=0) for c in (0, 1)] == [0, 5]
    assert [layout.get_num_layers_to_build(vp_stage=c, pp_rank=0) for c in (0, 1)] == [1, 2]
    mtp = [layout.get_num_layers_to_build(LayerType.mtp, vp_stage=c, pp_rank=0) for c in (0, 1)]
    assert mtp == [0, 1]
    # Megatron's TransformerConfig refuses the split arguments beside a layout: folded in it.
    assert seen[0].decoder_first_pipeline_num_layers is None
    assert args.decoder_first_pipeline_num_layers == 1  # args untouched


def test_embedding_ranks_hook() -> None:
    assert megatron_lm.embedding_ranks(_args(), [4, 5, 6, 7]) == [4]
    assert megatron_lm.embedding_ranks(_args(pipeline_schedule="dualpipe"), [4, 5]) == [4]
    assert megatron_lm.embedding_ranks(_args(pipeline_schedule="zb1p"), [4, 5]) is None


def test_build_model_chunks_refuses_a_config_without_our_layout() -> None:
    args = _args(pipeline_model_parallel_size=2, num_layers=8, global_batch_size=8)
    with pytest.raises(DualPipeConfigError, match="StagePlacementLayout"):
        megatron_lm.build_model_chunks(
            _Chunk,
            args,
            lambda a: None,
            pp_rank=0,
            config=argparse.Namespace(pipeline_model_parallel_layout=None),
        )


@pytest.mark.parametrize(
    ("schedule", "two_chunks"),
    [
        (None, False),
        ("1f1b", False),
        ("interleaved-1f1b", False),
        ("zb1p", False),
        ("dualpipe", True),
        ("dualpipev", True),
    ],
)
def test_which_schedules_use_the_placement_and_batch_hooks(
    schedule: str | None, two_chunks: bool
) -> None:
    args = _args(pipeline_schedule=schedule)
    assert megatron_lm.places_model_chunks(args) is two_chunks
    assert megatron_lm.full_batch_on_this_rank(args) is two_chunks
    losses = [{"lm loss": torch.tensor([1.0, 2.0])}]
    if not two_chunks:
        assert megatron_lm.losses_on_last_stage(losses, args) is losses


def _gather_losses(rank: int, world_size: int, schedule: str) -> tuple[list[dict], Any]:
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_dualpipe.megatron.compat.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # the tracker's device

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    try:
        # dualpipev: the losses are all on pipeline rank 0; dualpipe: on the first and last
        has_losses = rank == 0 or (schedule == "dualpipe" and rank == world_size - 1)
        mine = (
            [{"lm loss": torch.tensor([10.0 * rank + m, 4.0])} for m in range(2)]
            if has_losses
            else []
        )
        fields = mtp_tracker_fields()  # ("values",); 0.19: losses, correct and total counts
        if has_losses:  # what GPTModel records for one MTP layer over this rank's batches
            recorded = [3.0 + 5.0 * (rank > 0), 7.0 + rank, 9.0 + rank][: len(fields)]
            save_mtp_metrics([torch.tensor(v) for v in recorded], 0, 1, avg_group=None)
        args = _args(pipeline_schedule=schedule, mtp_num_layers=1)
        out = megatron_lm.losses_on_last_stage(mine, args)
        tracked = {f: MTPLossLoggingHelper.tracker.get(f) for f in fields}
        tracked = {f: v.tolist() for f, v in tracked.items() if v is not None} or None
        return [{k: v.tolist() for k, v in report.items()} for report in out], tracked
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule", one_fast(["dualpipev", "dualpipe"], "dualpipe"))
def test_losses_reach_the_last_stage(schedule: str) -> None:
    per_rank = run_workers(_gather_losses, 4, args=(schedule,), timeout_s=60)
    first = [{"lm loss": [0.0, 4.0]}, {"lm loss": [1.0, 4.0]}]
    last = [{"lm loss": [30.0, 4.0]}, {"lm loss": [31.0, 4.0]}] if schedule == "dualpipe" else []
    assert [reports for reports, _ in per_rank] == [[], [], [], first + last]
    # Megatron's MTP tracker: the pipeline's sums on the last stage, cleared where they were.
    last_rank = schedule == "dualpipe"
    sums = [3.0 + 8.0 * last_rank, 7.0 + 10.0 * last_rank, 9.0 + 12.0 * last_rank]
    fields = mtp_tracker_fields()
    cleared = {f: [0.0] for f in fields}
    assert [tracked for _, tracked in per_rank] == [
        cleared,
        None,
        None,
        {f: [s] for f, s in zip(fields, sums, strict=False)},
    ]


def _route_chunks(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    """Megatron-LM's get_model path on CPU: build_model_chunks with a GPT model provider
    (local spec: no TE here), then the DDP config hook."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_dualpipe.megatron.compat.cpu_compat import apply_cpu_compat
    from megatron_dualpipe.megatron.grads.deferral import (
        DeferrableColumnParallelLinear,
        DeferrableRowParallelLinear,
    )
    from tests import tiny_models as tm

    apply_cpu_compat()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    try:
        args = _args(
            pipeline_schedule=schedule,
            pipeline_model_parallel_size=world_size,
            num_layers=8,
            global_batch_size=8,
            transformer_impl="local",
        )

        def config_from_args(a: argparse.Namespace) -> Any:
            config = tm.tiny_gpt_config(num_layers=8, pipeline_model_parallel_size=world_size)
            config.pipeline_model_parallel_layout = a.pipeline_model_parallel_layout
            return config

        def provider(*, pre_process: bool, post_process: bool, vp_stage: Any, config: Any):
            return tm.build_tiny_gpt(
                config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
            )

        chunks = megatron_lm.build_model_chunks(provider, args, config_from_args, pp_rank=rank)
        linears = [
            (n, type(m))
            for c in chunks
            for n, m in c.named_modules()
            if isinstance(m, ColumnParallelLinear | RowParallelLinear)
        ]
        plain = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=123)
        ddp = megatron_lm.ddp_config(plain, args)
        return {
            "linears": len(linears),
            "not_deferring": [
                n
                for n, t in linears
                if t not in (DeferrableColumnParallelLinear, DeferrableRowParallelLinear)
            ],
            "output_layer": any(n == "output_layer" for n, _ in linears),
            "ddp": (ddp.delay_wgrad_compute, ddp.overlap_grad_reduce, ddp.bucket_size),
            "plain_untouched": megatron_lm.ddp_config(plain, _args(pipeline_schedule="1f1b"))
            is plain,
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.parametrize("schedule", one_fast(["dualpipev", "zb1p"], "dualpipev"))
def test_megatron_lm_route_builds_chunks_whose_linear_layers_defer(schedule: str) -> None:
    """Megatron-LM's get_model (through the patch) builds zb1p, dualpipe and dualpipev
    chunks as train does: every linear layer defers its dW, the output layer included, and
    DDP's config keeps its fields and gains delay_wgrad_compute (else B computes dW inline
    and W is empty, as before)."""
    per_rank = run_workers(_route_chunks, 2, args=(schedule,), timeout_s=120)
    for result in per_rank:
        assert result["linears"] > 0 and result["not_deferring"] == []
        assert result["ddp"] == (True, True, 123) and result["plain_untouched"]
    # the output layer: dualpipev's loss is on rank 0, zb1p's on the last rank
    assert [r["output_layer"] for r in per_rank] == [schedule == "dualpipev", schedule == "zb1p"]


# --------------------------------------------------------------------------------------
# The patch file


def _parse_patch(text: str) -> dict[str, list[tuple[int, int, int, int, list[str]]]]:
    """{path: [(old_start, old_len, new_start, new_len, body lines)]}; raises on malformed."""
    files: dict[str, list[tuple[int, int, int, int, list[str]]]] = {}
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("diff --git "))
    current: list[tuple[int, int, int, int, list[str]]] | None = None
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            match = re.fullmatch(r"diff --git a/(\S+) b/(\S+)", line)
            assert match and match[1] == match[2], line
            assert lines[i + 1].startswith("index "), lines[i + 1]
            assert lines[i + 2] == f"--- a/{match[1]}", lines[i + 2]
            assert lines[i + 3] == f"+++ b/{match[1]}", lines[i + 3]
            current = files.setdefault(match[1], [])
            i += 4
            continue
        match = re.fullmatch(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@.*", line)
        assert match and current is not None, f"line {i + 1}: {line!r}"
        old_start, old_len, new_start, new_len = map(int, match.groups())
        body, old, new = [], 0, 0
        i += 1
        while i < len(lines) and (old < old_len or new < new_len):
            body.append(lines[i])
            kind = lines[i][:1]
            assert kind in (" ", "-", "+") or lines[i] == "", f"line {i + 1}: {lines[i]!r}"
            old += kind in (" ", "-", "")
            new += kind in (" ", "+", "")
            i += 1
        assert (old, new) == (old_len, new_len), f"hunk {line!r}: counts do not match its body"
        current.append((old_start, old_len, new_start, new_len, body))
    return files


def test_there_is_one_patch_per_megatron_lm_tag() -> None:
    assert sorted(p.name for p in PATCHES.glob("*.patch")) == [
        f"megatron-lm-{tag}.patch" for tag in sorted(PATCHED_FILES)
    ]


@pytest.mark.parametrize("tag", sorted(PATCHED_FILES))
def test_patch_is_a_well_formed_git_patch_of_the_intended_files(tag: str) -> None:
    text = (PATCHES / f"megatron-lm-{tag}.patch").read_text()
    header = text.split("diff --git", 1)[0]
    assert header.splitlines()[0].endswith(f"(tag {tag}).")
    assert f"git apply /path/to/megatron-dualpipe/patches/megatron-lm-{tag}.patch" in header
    files = _parse_patch(text)
    assert set(files) == PATCHED_FILES[tag]
    for path, hunks in files.items():
        starts = [h[0] for h in hunks]
        assert starts == sorted(starts), f"{path}: hunks out of order"
        for _, _, _, _, body in hunks:
            assert any(line.startswith("+") for line in body), f"{path}: a hunk adds nothing"


@pytest.mark.parametrize("tag", sorted(PATCHED_FILES))
def test_patch_calls_only_hooks_that_exist(tag: str) -> None:
    text = (PATCHES / f"megatron-lm-{tag}.patch").read_text()
    files = _parse_patch(text)
    added = "\n".join(
        line[1:]
        for hunks in files.values()
        for *_, body in hunks
        for line in body
        if line.startswith("+")
    )
    used = set(re.findall(r"dualpipe_lm\.(\w+)", added))
    used |= set(re.findall(r"from megatron_dualpipe\.megatron_lm import (\w+)", added))
    assert used >= {
        "add_arguments",
        "apply",
        "build_model_chunks",
        "builds_model_chunks",
        "cuda_graph_helper",
        "ddp_config",
        "embedding_ranks",
        "float16_chunks",
        "forward_backward_func",
        "full_batch_on_this_rank",
        "losses_on_last_stage",
        "places_model_chunks",
        "prepare_model",
    }
    assert used <= set(megatron_lm.__all__), used - set(megatron_lm.__all__)
    assert "--pipeline-schedule" in text.split("diff --git", 1)[0]  # usage header


def test_every_supported_release_has_its_tags_patch() -> None:
    assert set(MEGATRON_LM_TAGS.values()) == set(PATCHED_FILES)


def test_the_installed_wheels_training_takes_its_tags_patch() -> None:
    """The wheels of megatron-core 0.17 and newer ship their Megatron-LM tag's
    megatron/training: the patch's hunks for it apply there (``git apply --check``)."""
    import megatron.core

    site = Path(megatron.core.__file__).resolve().parents[2]
    if not (site / "megatron" / "training").is_dir():
        pytest.skip(f"megatron-core {megatron.core.__version__} ships no megatron/training")
    patch = PATCHES / f"megatron-lm-{megatron_lm_tag()}.patch"
    done = subprocess.run(
        ["git", "apply", "--check", "-v", "--include=megatron/training/*", str(patch)],
        cwd=site, env=outside_any_work_tree(site), capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # a site-packages inside a git work tree (CI's .ci/venv312) skipped every file, rc 0
    assert "Checking patch megatron/training/training.py..." in done.stderr, done.stderr


def test_the_megatron_lm_script_refuses_a_release_without_its_training(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """scripts/pretrain_gpt_megatron_lm.py drives 0.19's ``pretrain``; before any of
    megatron.training is imported, another release is one sentence."""
    import importlib.util

    import megatron.core

    script = PATCHES.parent / "scripts" / "pretrain_gpt_megatron_lm.py"
    spec = importlib.util.spec_from_file_location("pretrain_gpt_megatron_lm", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(megatron.core, "__version__", "0.18.2")
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert str(stop.value).startswith(
        "error: this script runs megatron-core 0.19's megatron.training (pretrain with a "
        "config container), but megatron-core 0.18.2 is installed: "
    )


def test_float16_chunks_convert_where_our_placement_puts_the_loss() -> None:
    from tests.tiny_models import tiny_gpt_config

    config = tiny_gpt_config(num_layers=8, bf16=True)
    args = _args(pipeline_model_parallel_size=2, num_layers=8, global_batch_size=8)
    chunks = [torch.nn.Identity(), torch.nn.Identity()]
    rank0 = megatron_lm.float16_chunks(chunks, config, args, pp_rank=0)
    rank1 = megatron_lm.float16_chunks(chunks, config, args, pp_rank=1)
    x = torch.ones(2, dtype=torch.bfloat16)
    # dualpipev: rank 0 holds the first stage (chunk 0) and the loss (chunk 1); rank 1 neither
    assert [c(x).dtype for c in rank0] == [torch.bfloat16, torch.float32]
    assert [c(x).dtype for c in rank1] == [torch.bfloat16, torch.bfloat16]
