"""A graph-safe executor step (``PipelineExecutor(graph_safe=True)``, what Megatron's
``full_iteration`` CUDA graph needs) synchronises nothing with the host: whole steps of
every schedule run on forked gloo ranks (plain gloo, and the NCCL-rules emulation whose
waits are stream waits), after a first step that sets the communicator up (as Megatron's
warm-up steps come before its capture), under a detector that records, from any thread, every host
synchronisation a capture cannot hold: ``Tensor.item`` / ``tolist`` / ``cpu``,
``torch.cuda.synchronize``, ``torch.cuda.Event.query`` / ``elapsed_time``, a
``work.wait(timeout)`` and an ``is_completed()`` poll. The default executor is shown to make
such calls (it waits with a deadline and polls its sends); the graph-safe one makes none and
gives the same losses and gradients."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_dualpipe.runtime import PipelineExecutor, TensorSpec, make_deferrable
from megatron_dualpipe.runtime.mirror import sync_mirror_grads
from megatron_dualpipe.schedules.registry import SCHEDULES, generate, spec
from tests import nccl_emulation
from tests.multiproc import run_workers

pytestmark = pytest.mark.multiproc

HIDDEN, BATCH = 8, 3
#: (class, method, whether only a call with a timeout counts) the detector records.
WATCHED: list[tuple[Any, str, bool]] = [
    (torch.Tensor, "item", False),
    (torch.Tensor, "tolist", False),
    (torch.Tensor, "cpu", False),
    (torch.cuda, "synchronize", False),
    (torch.cuda.Event, "query", False),
    (torch.cuda.Event, "elapsed_time", False),
    (dist.Work, "wait", True),
    (dist.Work, "is_completed", False),
    # The works of the NCCL-rules emulation poll the same way.
    (nccl_emulation._Work, "wait", True),
    (nccl_emulation._Work, "is_completed", False),
]


@contextlib.contextmanager
def host_sync_detector() -> Iterator[list[str]]:
    """Record (not forbid: a failing call would hang the peers) every watched call made
    while the block runs, from any thread; the methods are restored after it."""
    calls: list[str] = []
    lock = threading.Lock()
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in WATCHED]

    def spy(owner: Any, name: str, original: Any, timed_only: bool) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            timed = len(args) > 1 or kwargs.get("timeout") is not None
            if not timed_only or timed:
                with lock:
                    calls.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)

        return call

    try:
        for (owner, name, timed_only), (_, _, original) in zip(WATCHED, saved, strict=True):
            setattr(owner, name, spy(owner, name, original, timed_only))
        yield calls
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _stages(count: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [
        torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh()) for _ in range(count)
    ]


def _step(rank: int, world: int, name: str, graph_safe: bool, nccl_rules: bool) -> Any:
    m = max(spec(name).min_microbatches(world), 2 * world)
    schedule = generate(name, world, m)
    placement = schedule.placement
    stages = _stages(placement.num_model_stages)
    modules = []
    for chunk in range(placement.num_chunks):
        module = stages[placement.model_stage(placement.stage_of(rank, chunk))]
        if placement.kind == "mirror" and chunk == 1:
            module = copy.deepcopy(module)  # the second copy, from the same weights
        make_deferrable(module)
        modules.append(module)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(BATCH, HIDDEN, generator=generator) for _ in range(m)]
    executor = PipelineExecutor(
        schedule,
        rank,
        modules,
        specs=dict.fromkeys(range(placement.num_stages), TensorSpec((BATCH, HIDDEN))),
        loss_fn=lambda out, mb: (out**2).mean(),
        timeout_s=20.0,
        transport=nccl_emulation.on_the_world() if nccl_rules else None,
        graph_safe=graph_safe,
    )
    executor.run(inputs)  # sets up the communicator: before a capture, as Megatron's warm-up
    for module in modules:
        module.zero_grad()
    with host_sync_detector() as calls:
        result = executor.run(inputs)
    if placement.kind == "mirror":
        sync_mirror_grads(modules, placement, rank, timeout_s=20.0)
    executor.close()
    grads = [p.grad.clone() for module in modules for p in module.parameters()]
    return sorted(set(calls)), result.losses, grads


def _run_all(rank: int, world: int, graph_safe: bool, nccl_rules: bool) -> dict[str, Any]:
    return {name: _step(rank, world, name, graph_safe, nccl_rules) for name in SCHEDULES}


@pytest.mark.parametrize("nccl_rules", [False, True], ids=["gloo", "nccl-rules"])
def test_a_graph_safe_step_synchronises_nothing_and_computes_the_same(nccl_rules: bool) -> None:
    eager = run_workers(_run_all, 2, args=(False, nccl_rules), timeout_s=120)
    safe = run_workers(_run_all, 2, args=(True, nccl_rules), timeout_s=120)
    for name in SCHEDULES:
        for rank in range(2):
            calls, losses, grads = safe[rank][name]
            assert calls == [], f"{name} rank {rank}: host synchronisation in the step: {calls}"
            _, eager_losses, eager_grads = eager[rank][name]
            assert losses.keys() == eager_losses.keys()
            for mb, loss in losses.items():
                assert torch.equal(loss, eager_losses[mb]), (name, mb)
            for a, b in zip(grads, eager_grads, strict=True):
                assert torch.equal(a, b), name


def test_what_the_default_executor_does_that_a_capture_cannot() -> None:
    """The finding, on plain gloo: a receive waits with a deadline (``Work.wait(timeout)``),
    and the sends are polled (``is_completed``) where some are pending at a wait. (Under
    the NCCL-rules emulation the default executor's hang monitor polls ``is_completed()``
    every 50 ms from its thread, so a step shorter than that may show no call: not asserted
    there.)"""
    eager = run_workers(_run_all, 2, args=(False, False), timeout_s=120)
    seen = {name: set(eager[0][name][0]) | set(eager[1][name][0]) for name in SCHEDULES}
    # Every receive waits with a deadline; the sends are polled only where some are still
    # pending at a wait, which depends on timing (so not asserted).
    assert all("Work.wait" in calls for calls in seen.values()), seen
    assert all(calls <= {"Work.wait", "Work.is_completed"} for calls in seen.values())


def test_graph_safe_refuses_what_reads_the_host() -> None:
    schedule = generate("1f1b", 1, 2)
    module = torch.nn.Linear(HIDDEN, HIDDEN)
    with pytest.raises(ValueError, match="^graph_safe needs static shapes"):
        PipelineExecutor(schedule, 0, [module], graph_safe=True, variable_shapes=True)
