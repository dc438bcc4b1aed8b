"""After apply_cpu_compat, Megatron's own schedules on CPU+gloo give the losses and
gradients of a one-process, unpipelined run of the same model on the same data (see
tests/megatron_harness.py for how runs are built and compared)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.tensor_parallel import random as megatron_random

from megatron_dualpipe.megatron.compat.cpu_compat import apply_cpu_compat, cpu_compat_applied
from tests.megatron_harness import (
    CPU_ONLY,
    REL_TOL,
    RUN_TIMEOUT_S,
    Layout,
    Model,
    _assert_close_by_name,
    _check,
    _init_parallel,
    _reference,
    _rel_err,
    _run,
)
from tests.multiproc import run_workers

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc, CPU_ONLY]


# --------------------------------------------------------------------------------------
# Tests.

ONE_F_ONE_B = "forward_backward_pipelining_without_interleaving"
INTERLEAVED = "forward_backward_pipelining_with_interleaving"


@pytest.mark.slow
def test_1f1b_pp2_matches_reference() -> None:
    _check(Model(), Layout(pp=2), ONE_F_ONE_B)


@pytest.mark.slow
def test_1f1b_pp4_tied_rope_ddp_matches_reference() -> None:
    # Tied embeddings with PP > 1 (LanguageModule.setup_embeddings_and_output_layer), RoPE
    # (RotaryEmbedding.get_emb), DDP buffers and finalize_model_grads.
    _check(Model(tied=True, rope=True), Layout(pp=4, ddp=True), ONE_F_ONE_B)


@pytest.mark.slow
def test_interleaved_pp2_vp2_matches_reference() -> None:
    # batch_p2p_comm=False: see the next test.
    _check(Model(), Layout(pp=2, vp=2), INTERLEAVED)


@pytest.mark.slow
def test_interleaved_pp2_with_batched_p2p_gives_wrong_gradients() -> None:
    # The upstream trap (Megatron-LM #750, #1450) that the other tests avoid with
    # batch_p2p_comm=False: at PP=2 both directions go to the same peer and batched
    # isend/irecv pairs are matched in queue order. This also shows the comparison has
    # teeth. If it starts failing, megatron fixed the trap: update docs/megatron-on-cpu.md.
    reference, results = _run(Model(), Layout(pp=2, vp=2, batch_p2p_comm=True))
    worst = max(
        _rel_err(grad, reference["grads"][name])
        for result in results
        for name, grad in result["grads"].items()
    )
    assert worst > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_pp2_ep2_dp2_matches_reference_through_optimizer_step(dispatcher: str) -> None:
    # 4 experts, top-2, two per EP rank; DP=2 data, DDP gradient reduction, Megatron's
    # chained optimizer with clipping by the global gradient norm.
    layout = Layout(pp=2, ep=2, dp=2, ddp=True, optimizer=True, dispatcher=dispatcher)
    _check(Model(moe=True), layout, ONE_F_ONE_B)


@pytest.mark.slow
def test_no_pipelining_schedule_matches_plain_loop() -> None:
    reference = _reference(Model(), 1)
    assert reference["no_pipelining_losses"] == pytest.approx(reference["losses"], rel=REL_TOL)
    _assert_close_by_name(
        "forward_backward_no_pipelining gradients",
        reference["no_pipelining_grads"],
        reference["grads"],
    )
    assert set(reference["no_pipelining_grads"]) == set(reference["grads"])


def _dropout_worker(rank: int, world_size: int) -> dict[str, Any]:
    _init_parallel()
    try:
        tracker = megatron_random.get_cuda_rng_tracker()
        ones = torch.ones(64, 64)

        def masks() -> list[torch.Tensor]:
            megatron_random.model_parallel_cuda_manual_seed(7)
            out = []
            with tracker.fork():
                out.append(torch.nn.functional.dropout(ones, 0.5))
                with tracker.fork(megatron_random.get_data_parallel_rng_tracker_name()):
                    out.append(torch.nn.functional.dropout(ones, 0.5))
                out.append(torch.nn.functional.dropout(ones, 0.5))
            return out

        torch.manual_seed(0)
        default_before = torch.get_rng_state()
        first = masks()
        default_unchanged = torch.equal(default_before, torch.get_rng_state())
        return {
            "first": first,
            "second": masks(),
            "default_unchanged": default_unchanged,
            "tracker": type(tracker).__name__,
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_cpu_rng_tracker_makes_dropout_reproducible() -> None:
    (result,) = run_workers(_dropout_worker, 1, timeout_s=RUN_TIMEOUT_S)
    assert result["tracker"] == "CpuRNGStatesTracker"
    first, second = result["first"], result["second"]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b), "same seed, different dropout mask"
    # A nested fork neither repeats nor disturbs the outer stream.
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[0], first[2])
    assert not torch.equal(first[1], first[2])
    assert result["default_unchanged"], "fork() leaked into the default CPU generator"
    kept = (first[0] != 0).float().mean().item()
    assert math.isclose(kept, 0.5, abs_tol=0.05)


def test_apply_cpu_compat_is_idempotent() -> None:
    view = megatron_schedules.torch
    tracker_class = megatron_random.CudaRNGStatesTracker
    apply_cpu_compat()
    assert cpu_compat_applied()
    assert megatron_schedules.torch is view and view is not torch
    assert megatron_random.CudaRNGStatesTracker is tracker_class
    assert view.cuda.current_device() == torch.device("cpu")
    assert view.zeros(2, device="cuda").device.type == "cpu"
    assert view.cuda.is_available is torch.cuda.is_available  # the rest is real torch


@pytest.mark.slow
def test_1f1b_tp2_pp2_matches_reference() -> None:
    _check(Model(), Layout(pp=2, tp=2), ONE_F_ONE_B)
