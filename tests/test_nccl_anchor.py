"""The anchor: DeepSeek's reference communication finishes under our NCCL model.

DeepSeek's DualPipe (the ``dualpipe`` package) and DualPipeV (deepseek-ai/DualPipe on
GitHub; PyPI's 1.0.0 has no DualPipeV: the test skips without it) run one real training
step on forked gloo ranks, on the CPU, with a recording stand-in for
``torch.distributed.batch_isend_irecv`` that passes every batch on to gloo: each batch
(what it sends and receives, named by the engine's own send and receive calls) and each
wait on its works, in order. Replayed under NCCL's rules with all of a rank's traffic on
one stream and every send waiting for its receive, that pattern finishes: a plan for
these schedules exists that needs no assumption about streams. Our lock-step plan is the
same kind (one batch per exchange point, waited before the next compute) and carries the
same messages.

The engines assume CUDA (their constructor compares the module's device with the current
CUDA device, their receive buffers are made on ``cuda``): in the worker those two are
pointed at the CPU, nothing else of the engine is touched.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_dualpipe.schedules.comm_plan import (
    CommOp,
    CommPlan,
    Init,
    Issue,
    Wait,
    comm_plan,
    pipeline_comm,
)
from megatron_dualpipe.schedules.ir import Kind, Placement
from megatron_dualpipe.schedules.nccl_rules import check_nccl
from megatron_dualpipe.schedules.registry import generate
from tests.multiproc import run_workers

pytestmark = pytest.mark.multiproc

HIDDEN, BATCH = 4, 2
#: The engine's send and receive calls: which message each names, and which way.
CALLS = {
    "_send_forward": (Kind.RECV_F, "send"),
    "_recv_forward": (Kind.RECV_F, "recv"),
    "_send_backward": (Kind.RECV_B, "send"),
    "_recv_backward": (Kind.RECV_B, "recv"),
}


class _Recorder:
    """Names every operation the engine appends by the message it carries and records
    each batch handed to ``batch_isend_irecv`` and each wait on its works."""

    def __init__(self, engine: nn.Module, placement: Placement, rank: int, mirrored: bool):
        self.engine, self.placement, self.rank = engine, placement, rank
        self.mirrored = mirrored  # DualPipe: the second half of the ranks swaps its phases
        self.counts: dict[tuple[str, int], int] = {}
        self.names: dict[int, tuple] = {}  # id of an appended P2POp -> (kind, key)
        self.steps: list = []
        self._batch_isend_irecv = dist.batch_isend_irecv
        for call in CALLS:
            setattr(engine, call, self._named(call, getattr(engine, call)))

    def _named(self, call: str, original):
        def named(phase: int, *args, **kwargs):
            before = len(self.engine.comm_ops)
            original(phase, *args, **kwargs)
            added = self.engine.comm_ops[before:]
            if not added:
                return
            chunk = phase ^ (self.mirrored and self.engine.is_in_second_half)
            count = self.counts.get((call, chunk), 0)
            self.counts[(call, chunk)] = count + 1
            p = self.placement
            # DualPipe's second direction carries the second half of the micro-batches.
            mb = count + (p.num_microbatches // 2 if self.mirrored and chunk else 0)
            stage = p.stage_of(self.rank, chunk)
            kind, way = CALLS[call]
            if way == "send":
                stage = p.next_stage(stage) if kind is Kind.RECV_F else p.prev_stage(stage)
            for op in added:
                self.names[id(op)] = (way, (kind, stage, mb))

        return named

    def batch_isend_irecv(self, ops: list) -> list:
        named = [(*self.names[id(op)], op.peer) for op in ops]
        self.steps.append(("issue", named))
        works = self._batch_isend_irecv(ops)
        keys = [key for _, key, _ in named]
        return [_Waited(work, key, self.steps) for work, key in zip(works, keys, strict=True)]


class _Waited:
    def __init__(self, work, key: tuple, steps: list):
        self._work, self._key, self._steps = work, key, steps

    def wait(self, *args):
        self._steps.append(("wait", self._key))
        return self._work.wait(*args)


def _cpu_buffers() -> list[torch.Tensor]:
    import dualpipe.comm as comm

    shapes, dtype = comm.TENSOR_SHAPES, comm.TENSOR_DTYPE
    return [torch.empty(s, dtype=dtype, requires_grad=True) for s in shapes]


def _record(rank: int, world: int, name: str, microbatches: int) -> list:
    """One step of DeepSeek's engine ``name`` on this rank: what it issued and waited."""
    import dualpipe
    import dualpipe.comm as comm

    engine_class = dualpipe.DualPipe if name == "dualpipe" else dualpipe.DualPipeV
    placement = generate(name, world, microbatches).placement
    torch.manual_seed(0)
    modules = (nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))
    dualpipe.set_p2p_tensor_shapes([(BATCH, HIDDEN)])
    dualpipe.set_p2p_tensor_dtype(torch.float32)
    with mock.patch("torch.cuda.current_device", return_value="cpu"):
        engine = engine_class(modules)
    recorder = _Recorder(engine, placement, rank, mirrored=name == "dualpipe")
    mirrored = name == "dualpipe"
    entering = rank == 0 or (mirrored and rank == world - 1)
    chunks = microbatches // 2 if mirrored else microbatches
    x = torch.randn(chunks * BATCH, HIDDEN)
    args, kwargs = ((x,), {"labels": (torch.zeros_like(x),)}) if entering else ((), {})
    with (
        mock.patch.object(comm, "build_from_tensor_shapes", _cpu_buffers),
        mock.patch.object(dist, "batch_isend_irecv", recorder.batch_isend_irecv),
    ):
        loss, _ = engine.step(
            *args,
            num_chunks=microbatches,
            criterion=lambda out, y: (out - y).square().mean(),
            **kwargs,
        )
    assert (loss is not None) == entering and (loss is None or torch.isfinite(loss).all())
    return recorder.steps


def _replay(name: str, world: int, microbatches: int, recorded: list) -> CommPlan:
    """The recorded pattern as a plan on one communicator: each batch an Issue, each wait
    a Wait, every message of unknown size (so every send waits for its receive)."""
    schedule = generate(name, world, microbatches)
    comm = pipeline_comm(schedule.placement)
    ranks = []
    for steps in recorded:
        plan = [Init(comm)]
        for what, value in steps:
            if what == "issue":
                plan.append(Issue(tuple(CommOp(way, peer, comm, key) for way, key, peer in value)))
            else:
                plan.append(Wait((value,)))
        ranks.append(plan)
    return CommPlan(schedule, ranks, False, False)


def _engine(name: str) -> None:
    dualpipe = pytest.importorskip("dualpipe")
    if name == "dualpipev" and not hasattr(dualpipe, "DualPipeV"):
        pytest.skip("the installed dualpipe has no DualPipeV: install deepseek-ai/DualPipe")


@pytest.mark.parametrize("microbatches", [10, 16])
@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_deepseeks_pattern_finishes_on_one_stream_with_every_send_waiting(name, microbatches):
    _engine(name)
    world = 4
    recorded = run_workers(_record, world, args=(name, microbatches), timeout_s=120)
    plan = _replay(name, world, microbatches, recorded)
    batches = [sum(isinstance(s, Issue) for s in steps) for steps in plan.ranks]
    assert all(batches)
    # Every message our schedule sends, named the same way, once each.
    ours = comm_plan(generate(name, world, microbatches))
    keys = {op.key for steps in ours.ranks for s in steps if isinstance(s, Issue) for op in s.ops}
    theirs = [op.key for steps in plan.ranks for s in steps if isinstance(s, Issue) for op in s.ops]
    assert sorted(theirs, key=str) == sorted([k for k in keys for _ in range(2)], key=str)
    # The anchor: all of a rank's traffic on one stream, every send a rendezvous.
    check_nccl(plan, streams="shared", collectives=(), eager_limit=0, bound=False)
    # Ours, of the same kind, under the same rules.
    check_nccl(ours, streams="shared", collectives=(), eager_limit=0, bound=False)
