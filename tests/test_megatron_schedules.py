"""Our schedules (zb1p, dualpipe, dualpipev) through Megatron-Core: one training step gives
the losses and gradients of a one-process, unpipelined run of the same model on the same
data, as Megatron's own 1F1B does (tests/test_megatron_cpu.py holds that for 1F1B)."""

from __future__ import annotations

import functools
import gc
import weakref
from typing import Any

import pytest
import torch
from megatron.core import parallel_state

from megatron_dualpipe.megatron.schedule.checks import DualPipeConfigError
from megatron_dualpipe.megatron.schedule.registry import get_forward_backward_func
from tests import tiny_models as tm
from tests.megatron_harness import (
    CPU_ONLY,
    MICRO_BATCH_SIZE,
    PG_TIMEOUT_S,
    RUN_TIMEOUT_S,
    Layout,
    Model,
    _check,
    _data,
    _init_parallel,
    _ready_chunks,
    _reference,
    _step,
    _trajectory,
)
from tests.multiproc import run_workers


@functools.cache
def _one_f_one_b_trajectory() -> list[float]:
    return _trajectory(Model(), Layout(pp=2, ddp=True, microbatches=4))


pytestmark = [pytest.mark.megatron, pytest.mark.multiproc, CPU_ONLY]


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_pp2_matches_reference(schedule: str) -> None:
    _check(Model(), Layout(pp=2, schedule=schedule), schedule)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_pp4_matches_reference(schedule: str) -> None:
    _check(Model(), Layout(pp=4, schedule=schedule), schedule)


@pytest.mark.slow
@pytest.mark.parametrize("overlap_grad_reduce", [False, True])
@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_dp2_pp2_ddp_matches_reference(schedule: str, overlap_grad_reduce: bool) -> None:
    layout = Layout(
        pp=2, dp=2, ddp=True, overlap_grad_reduce=overlap_grad_reduce, schedule=schedule
    )
    _check(Model(), layout, schedule)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_moe_matches_reference_through_optimizer_step(schedule: str, ep: int) -> None:
    layout = Layout(pp=2, ep=ep, dp=ep, ddp=True, optimizer=True, schedule=schedule)
    _check(Model(moe=True), layout, schedule)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_five_adam_steps_follow_1f1b_loss_trajectory(schedule: str) -> None:
    """Megatron's DDP, Adam with clipping, five iterations: the same losses as Megatron's
    own 1F1B."""
    expected = _one_f_one_b_trajectory()
    actual = _trajectory(Model(), Layout(pp=2, ddp=True, microbatches=4, schedule=schedule))
    assert actual == pytest.approx(expected, rel=1e-5)
    assert actual[-1] < actual[0], "five Adam steps should lower the loss"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_tp2_pp2_matches_reference(schedule: str) -> None:
    _check(Model(), Layout(pp=2, tp=2, schedule=schedule), schedule)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_without_deferral_matches_reference(schedule: str) -> None:
    layout = Layout(
        pp=2, dp=2, ddp=True, overlap_grad_reduce=True, schedule=schedule, deferral=False
    )
    _check(Model(), layout, schedule)


MANY_BUCKETS = 2_000  # elements: the tiny model's stages span several DDP buckets


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_distributed_optimizer_with_small_buckets_matches_reference(schedule: str) -> None:
    """DP=2, distributed optimizer, overlap_grad_reduce, a DDP bucket size that cuts a stage
    into several buckets: on every rank the shard of every ``main_grad`` that rank owns
    equals the reference, and every element is owned somewhere. (dualpipe's mirror sum runs
    after the reduce-scatter; both copies of a stage are bucketed alike, one bucket per
    chunk, as train wraps them.)"""
    layout = Layout(
        pp=2,
        dp=2,
        ddp=True,
        overlap_grad_reduce=True,
        distributed_optimizer=True,
        bucket_size=MANY_BUCKETS,
        schedule=schedule,
    )
    _check(Model(), layout, schedule)


def test_dualpipe_refuses_copies_of_a_stage_bucketed_differently() -> None:
    """Wrapped as Megatron-LM's get_model wraps chunks (pipeline rank 0's first chunk
    bucketed, every other chunk one bucket), the two copies of stage 0 are bucketed
    differently: prepare_mirrors refuses it before the first step, in one sentence."""
    layout = Layout(
        pp=2,
        ddp=True,
        overlap_grad_reduce=True,
        bucket_size=MANY_BUCKETS,
        schedule="dualpipe",
        megatron_lm_bucketing=True,
    )
    refused = "buckets dualpipe's two copies of a stage differently"
    with pytest.raises(AssertionError, match=refused):
        _check(Model(), layout, "dualpipe")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_distributed_optimizer_follows_1f1b_loss_trajectory(schedule: str) -> None:
    """DP=2 with Megatron's distributed optimizer (Adam, sharded state, reduce-scatter of
    gradients) against 1F1B with the plain optimizer: the same five losses."""
    expected = _trajectory(Model(), Layout(pp=2, dp=2, ddp=True, microbatches=4))
    layout = Layout(
        pp=2, dp=2, ddp=True, microbatches=4, distributed_optimizer=True, schedule=schedule
    )
    assert _trajectory(Model(), layout) == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_tied_embeddings_match_reference_through_optimizer_step(schedule: str) -> None:
    # The embedding and its copy for the output layer share one rank: summed locally.
    layout = Layout(pp=2, ddp=True, optimizer=True, schedule=schedule)
    _check(Model(tied=True), layout, schedule)


@pytest.mark.slow
def test_tied_embeddings_work_with_zb1p() -> None:
    # zb1p keeps Megatron's placement, so Megatron's embedding group ties them correctly.
    _check(Model(tied=True), Layout(pp=2, ddp=True, schedule="zb1p"), "zb1p")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_megatrons_explicit_process_groups_are_used(schedule: str) -> None:
    layout = Layout(pp=2, dp=2, ddp=True, schedule=schedule, explicit_groups=True)
    _check(Model(), layout, schedule)


def _lifetime_worker(rank: int, world_size: int, state: dict[str, torch.Tensor]) -> dict:
    """Two steps reuse one executor; dropping the model frees it and its executor; a
    half-given pair of explicit groups is refused."""
    layout = Layout(pp=2, schedule="dualpipev")
    _init_parallel(layout.pp)
    try:
        forward_backward = get_forward_backward_func(pipeline_schedule="dualpipev")
        chunks = _ready_chunks(Model(), layout, state, ddp=False)
        batches = _data(0)
        _step(forward_backward, chunks, batches, layout)
        first = forward_backward.executor(chunks)
        _step(forward_backward, chunks, batches, layout)
        reused = forward_backward.executor(chunks) is first and first is not None
        try:
            forward_backward(
                forward_step_func=None,
                data_iterator=None,
                model=chunks,
                num_microbatches=8,
                seq_length=16,
                micro_batch_size=2,
                pg_collection=parallel_state,
            )
            refusal = None
        except DualPipeConfigError as err:
            refusal = str(err)
        model_ref = weakref.ref(chunks[0])
        del chunks, first
        gc.collect()
        return {
            "reused": reused,
            "freed": model_ref() is None,
            "cached": len(forward_backward._prepared),
            "refusal": refusal,
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_one_executor_per_model_and_a_dropped_model_is_freed() -> None:
    state = _reference(Model(), 1)["state"]
    results: list[dict[str, Any]] = run_workers(
        _lifetime_worker, 2, args=(state,), timeout_s=RUN_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S
    )
    for result in results:
        assert result["reused"] and result["freed"] and result["cached"] == 0, result
        assert result["refusal"] == (
            "dualpipev: pass both p2p_communicator and pg_collection, or neither (as "
            "Megatron's own schedules require)"
        )


def _param_sync_worker(
    rank: int, world_size: int, schedule: str, state: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """One training step and one forward-only step, recording each chunk's forwards (a
    pre-hook) and each call of ``config.param_sync_func`` (one per chunk, as Megatron-LM
    sets DDP's ``start_param_sync``)."""
    layout = Layout(pp=2, schedule=schedule, microbatches=4)
    _init_parallel(layout.pp, schedule=schedule)
    try:
        chunks = _ready_chunks(Model(), layout, state, ddp=False)
        events: list[tuple[str, int]] = []
        same_params = []

        def sync(chunk: int, params: Any) -> None:
            same_params.append(list(params) == list(chunks[chunk].parameters()))
            events.append(("sync", chunk))

        for chunk, module in enumerate(chunks):
            module.register_forward_pre_hook(lambda *_, c=chunk: events.append(("forward", c)))
        config = chunks[0].config
        config.param_sync_func = [functools.partial(sync, c) for c in range(len(chunks))]
        schedule_fn = get_forward_backward_func(pipeline_schedule=schedule)
        batches = _data(parallel_state.get_data_parallel_rank(), layout.microbatches)
        _step(schedule_fn, chunks, batches, layout)
        training = list(events)
        events.clear()
        schedule_fn(
            forward_step_func=tm.gpt_forward_step,
            data_iterator=iter(batches),
            model=chunks,
            num_microbatches=layout.microbatches,
            seq_length=tm.SEQ_LENGTH,
            micro_batch_size=MICRO_BATCH_SIZE,
            forward_only=True,
        )
        from megatron.core.transformer.cuda_graphs import is_graph_capturing

        return {
            "training": training,
            "forward_only": events,
            "same_params": same_params,
            "watch_paused": schedule_fn.executor(chunks).watch_paused is is_graph_capturing,
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_param_sync_func_runs_for_every_chunk_before_any_forward(schedule: str) -> None:
    """Under ``--overlap-param-gather`` Megatron-LM sets ``config.param_sync_func`` (DDP's
    ``start_param_sync`` per chunk) and its interleaved schedule launches its first two
    chunks' gathers at the step's start; ours launch every chunk's there (so that each
    overlaps the work before its chunk's first forward), once per training step, with
    that chunk's parameters, and not in forward-only steps (nor does Megatron)."""
    state = _reference(Model(), 1)["state"]
    results = run_workers(
        _param_sync_worker,
        2,
        args=(schedule, state),
        timeout_s=RUN_TIMEOUT_S,
        pg_timeout_s=PG_TIMEOUT_S,
    )
    for rank, result in enumerate(results):
        training = result["training"]
        chunks = sorted({c for kind, c in training if kind == "forward"})
        assert chunks == list(range(1 if schedule == "zb1p" else 2)), (rank, training)
        assert training[: len(chunks)] == [("sync", c) for c in chunks], (rank, training)
        assert all(kind == "forward" for kind, _ in training[len(chunks) :]), (rank, training)
        assert all(result["same_params"]), rank
        assert result["forward_only"] and all(k == "forward" for k, _ in result["forward_only"])
        # The executor's hang monitor rests while Megatron captures CUDA graphs.
        assert result["watch_paused"], rank
