"""Our schedules (zb1p, dualpipe, dualpipev) through Megatron-Core: one training step gives
the losses and gradients of a one-process, unpipelined run of the same model on the same
data, as Megatron's own 1F1B does (tests/test_megatron_cpu.py holds that for 1F1B)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.megatron_harness import Layout, Model, _check, _trajectory


@functools.cache
def _one_f_one_b_trajectory() -> list[float]:
    return _trajectory(Model(), Layout(pp=2, ddp=True, microbatches=4))


pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU+gloo tests: apply_cpu_compat is a no-op with CUDA"
)


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_pp2_matches_reference(schedule: str) -> None:
    _check(Model(), Layout(pp=2, schedule=schedule), schedule)


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_pp4_matches_reference(schedule: str) -> None:
    _check(Model(), Layout(pp=4, schedule=schedule), schedule)


@pytest.mark.parametrize("overlap_grad_reduce", [False, True])
@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_dp2_pp2_ddp_matches_reference(schedule: str, overlap_grad_reduce: bool) -> None:
    layout = Layout(
        pp=2, dp=2, ddp=True, overlap_grad_reduce=overlap_grad_reduce, schedule=schedule
    )
    _check(Model(), layout, schedule)


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_moe_matches_reference_through_optimizer_step(schedule: str, ep: int) -> None:
    layout = Layout(pp=2, ep=ep, dp=ep, ddp=True, optimizer=True, schedule=schedule)
    _check(Model(moe=True), layout, schedule)


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_five_adam_steps_follow_1f1b_loss_trajectory(schedule: str) -> None:
    """Megatron's DDP, Adam with clipping, five iterations: the same losses as Megatron's
    own 1F1B."""
    expected = _one_f_one_b_trajectory()
    actual = _trajectory(Model(), Layout(pp=2, ddp=True, microbatches=4, schedule=schedule))
    assert actual == pytest.approx(expected, rel=1e-5)
    assert actual[-1] < actual[0], "five Adam steps should lower the loss"


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_tp2_pp2_matches_reference(schedule: str) -> None:
    _check(Model(), Layout(pp=2, tp=2, schedule=schedule), schedule)


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_without_deferral_matches_reference(schedule: str) -> None:
    layout = Layout(
        pp=2, dp=2, ddp=True, overlap_grad_reduce=True, schedule=schedule, deferral=False
    )
    _check(Model(), layout, schedule)


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipe", "dualpipev"])
def test_distributed_optimizer_follows_1f1b_loss_trajectory(schedule: str) -> None:
    """DP=2 with Megatron's distributed optimizer (Adam, sharded state, reduce-scatter of
    gradients) against 1F1B with the plain optimizer: the same five losses."""
    expected = _trajectory(Model(), Layout(pp=2, dp=2, ddp=True, microbatches=4))
    layout = Layout(
        pp=2, dp=2, ddp=True, microbatches=4, distributed_optimizer=True, schedule=schedule
    )
    assert _trajectory(Model(), layout) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_tied_embeddings_are_refused_in_one_sentence(schedule: str) -> None:
    with pytest.raises(AssertionError, match=f"{schedule} does not support tied embeddings yet"):
        _check(Model(tied=True), Layout(pp=2, schedule=schedule), schedule)


def test_tied_embeddings_work_with_zb1p() -> None:
    # zb1p keeps Megatron's placement, so Megatron's embedding group ties them correctly.
    _check(Model(tied=True), Layout(pp=2, ddp=True, schedule="zb1p"), "zb1p")
