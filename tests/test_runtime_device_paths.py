"""What the runtime does for GPUs, held on CPU with stand-ins.

- Timelines on a GPU measure with CUDA events read after the step (kernel time, not launch
  time): a stand-in following ``torch.cuda.Event``'s API (``record``, ``synchronize``,
  ``elapsed_time``) gives known times, and the timeline reports them.
- The barrier before a recorded step names the current GPU on NCCL (``device_ids``).
- The per-token loss count stays on the loss's device (a ``meta`` tensor stands for a GPU
  one: copying it to the host fails, as a per-micro-batch sync would).
- The executor's saved-tensor hook makes no reference cycle: after a step that fails
  half-way, nothing is left holding activations, no helper thread is left, and the executor
  refuses another step (on NCCL its messages could still be in flight).
- On a GPU the pipeline group is aborted after a hang (the mirror exchange's waits:
  ``test_mirror_exchange.py``).
- Mirror exchange memory: summing DualPipe's two copies takes the receive buffers of the
  two buckets in flight, measured by every allocation made during the exchange.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dualpipe.runtime import PipelineExecutor, TensorSpec
from megatron_dualpipe.runtime.mirror import param_buckets, param_grad, sync_mirror_grads
from megatron_dualpipe.runtime.timeline import (
    DeviceClock,
    HostClock,
    RankTimeline,
    aligned_timelines,
    clock_for,
    host_boot_id,
    start_barrier,
)
from megatron_dualpipe.runtime.transport import GroupTransport
from megatron_dualpipe.runtime.watchdog import HangMonitor, Watchdog
from megatron_dualpipe.schedules.ir import Action, Kind, Placement
from megatron_dualpipe.schedules.registry import generate
from tests.multiproc import run_workers


class FakeEvent:
    """``torch.cuda.Event(enable_timing=True)`` as the timeline uses it: ``record()`` takes
    the device's time when the stream reaches it, ``synchronize()`` waits for it,
    ``elapsed_time(end)`` is milliseconds from this event to ``end``."""

    device_ms = [0.0]  # the stand-in device's clock
    synchronized: list[FakeEvent] = []

    def record(self) -> None:
        self.at = FakeEvent.device_ms[0]

    def synchronize(self) -> None:
        FakeEvent.synchronized.append(self)

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at - self.at


def test_a_gpu_timeline_reports_event_times_read_after_the_step() -> None:
    FakeEvent.device_ms[0], FakeEvent.synchronized = 5.0, []
    clock = clock_for(torch.device("cuda", 0), event=FakeEvent)
    assert isinstance(clock, DeviceClock)
    timeline = RankTimeline(0, clock=clock)
    f = Action(Kind.F, 0, 0)
    FakeEvent.device_ms[0] = 7.0
    start = timeline.now()
    FakeEvent.device_ms[0] = 10.5  # the kernels ran 3.5 ms, however soon the host went on
    timeline.add(f, start, timeline.now())
    timeline.sent.append(((Kind.RECV_F, 1, 0), 1, timeline.now()))
    timeline.resolve()
    assert timeline.actions[0].start == 2.0 and timeline.actions[0].end == 5.5
    assert timeline.sent[0][2] == 5.5
    assert len(FakeEvent.synchronized) == 1  # once, for the last event, at the end
    assert timeline.clock is None and timeline.resolve() is timeline


def test_a_cpu_timeline_uses_the_host_clock() -> None:
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    assert isinstance(clock_for(None), HostClock)


def _timeline_at(rank: int, wall: float, host: tuple[str, float] | None) -> RankTimeline:
    timeline = RankTimeline(rank, clock=None, wall_origin=wall, host_origin=host)
    timeline.add(Action(Kind.F, 0, 0), 0.0, 1.0)
    return timeline


def test_timelines_align_on_one_hosts_monotonic_origins_else_on_the_wall_clock() -> None:
    one_host = [_timeline_at(0, 100.0, ("boot", 5.0)), _timeline_at(1, 100.9, ("boot", 5.25))]
    assert [t.actions[0].start for t in aligned_timelines(one_host)] == [0.0, 250.0]
    two_hosts = [_timeline_at(0, 100.0, ("a", 5.0)), _timeline_at(1, 100.5, ("b", 5.25))]
    assert [t.actions[0].start for t in aligned_timelines(two_hosts)] == [0.0, 500.0]
    unknown = [_timeline_at(0, 100.5, None), _timeline_at(1, 100.0, ("boot", 5.0))]
    assert [t.actions[0].start for t in aligned_timelines(unknown)] == [500.0, 0.0]
    assert RankTimeline(0).host_origin[0] == host_boot_id()


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("nccl", {"device_ids": [3]}), ("cpu:gloo,cuda:nccl", {"device_ids": [3]}), ("gloo", {})],
)
def test_the_timeline_barrier_names_the_gpu_on_nccl(monkeypatch, backend, expected) -> None:
    """On NCCL the barrier before recording runs on the current GPU (``device_ids``), not
    on one torch guesses; elsewhere it is the plain barrier (gloo refuses device ids)."""
    calls = []
    group = object()
    monkeypatch.setattr(torch.distributed, "get_backend", lambda g=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.distributed, "barrier", lambda **kw: calls.append(kw))
    start_barrier(group)
    assert calls == [{"group": group, **expected}]


def test_the_token_count_stays_on_the_losses_device() -> None:
    from megatron_dualpipe.megatron.model.placement import ChunkRole
    from megatron_dualpipe.megatron.schedule.stage import MegatronStage, StepInputs

    meta = torch.device("meta")
    step = StepInputs(None, None, 1, False, False, None, 1, device=meta)
    assert step.total_num_tokens.device == meta
    model = nn.Linear(1, 1)
    role = ChunkRole(0, 0, 0, 0, 1, pre_process=True, post_process=True)
    stage = MegatronStage(model, role)
    stage.begin_step(step, None)
    stage._count_tokens(torch.ones((), dtype=torch.int, device=meta))
    assert step.total_num_tokens.device == meta


class _Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).tanh()  # tanh saves its own output


def _fail_half_way(rank: int, world: int) -> tuple[int, int]:
    executor = PipelineExecutor(
        generate("1f1b", 1, 4),
        0,
        [_Failing()],
        specs={0: TensorSpec((2, 4))},
        loss_fn=lambda out, mb: out.sum() if mb < 2 else 1 / 0,
    )
    with contextlib.suppress(ZeroDivisionError):
        executor.run([torch.ones(2, 4)] * 4)
    live_before_gc = executor.live_activations
    gc.collect()
    try:
        executor.run([torch.ones(2, 4)] * 4)
    except RuntimeError as error:
        again = str(error)
    executor.close()
    helpers = [t.name for t in threading.enumerate() if t.name.startswith("pipeline-")]
    return live_before_gc, executor.live_activations, again, helpers


@pytest.mark.multiproc
def test_a_failed_step_leaves_nothing_held_and_the_executor_refuses_another() -> None:
    """No activations held (before any garbage collection), no helper thread left, and a
    second run refused: on NCCL its messages could still be in flight."""
    ((before_gc, after_gc, again, helpers),) = run_workers(_fail_half_way, 1, timeout_s=60)
    assert (before_gc, after_gc) == (0, 0)
    assert again.startswith("rank 0's executor failed in an earlier step (ZeroDivisionError: ")
    assert helpers == []


def test_the_hang_monitor_thread_ends_with_its_monitor() -> None:
    monitor = HangMonitor(Watchdog(0, 60.0), lambda: None, poll_s=0.01)
    thread = monitor._thread
    del monitor
    gc.collect()
    thread.join(2)
    assert not thread.is_alive()


class _FakeGroup:
    """A process group as GroupTransport.abort uses one (``abort``)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def abort(self) -> None:
        self.calls.append("abort")


def test_the_pipeline_group_on_a_gpu_is_aborted() -> None:
    """After a hang, aborting the plan's one group makes every pending operation fail."""
    calls: list[str] = []
    GroupTransport(_FakeGroup(calls), [0, 1], device=torch.device("cuda", 0)).abort()
    assert calls == ["abort"]


class _Allocations(TorchDispatchMode):
    """Bytes of the tensors the ops create while active, the most alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _gone(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.untyped_storage().data_ptr() not in inputs
            ):
                nbytes = tensor.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._gone, nbytes)
        return out


BUCKET = 4096  # bytes: a stage of 3 x 1,056 floats spans several buckets


def _mirror_memory(rank: int, world: int) -> tuple[int, int, list[float]]:
    torch.manual_seed(0)
    modules = [nn.Sequential(*(nn.Linear(32, 32) for _ in range(3))) for _ in range(2)]
    for chunk, module in enumerate(modules):
        for p in module.parameters():
            p.grad = torch.full_like(p, float(10 * rank + chunk))
    placement = Placement("mirror", world, 2 * world, 2)
    meter = _Allocations()
    with meter:
        sync_mirror_grads(
            modules,
            placement,
            rank,
            timeout_s=20,
            buckets=lambda m: param_buckets(m, param_grad, bucket_bytes=BUCKET),
        )
    total = sum(p.numel() * 4 for p in modules[0].parameters())
    return meter.peak, total, [m[0].weight.grad[0, 0].item() for m in modules]


@pytest.mark.multiproc
def test_the_mirror_exchange_takes_two_buckets_of_memory() -> None:
    results = run_workers(_mirror_memory, 2, timeout_s=60)
    sizes = [
        sum(t.numel() * 4 for t in bucket)
        for bucket in param_buckets(
            nn.Sequential(*(nn.Linear(32, 32) for _ in range(3))), lambda p: p, BUCKET
        )
    ]
    two = max(a + b for a, b in zip(sizes, sizes[1:], strict=False))  # two in flight
    for rank, (peak, total, sums) in enumerate(results):
        print(f"rank {rank}: peak {peak} bytes, two buckets {two}, gradients {total}")
        assert peak <= two + 64, (rank, peak, two)  # + the layout's few integers
        assert peak < total / 2, (rank, peak, total)
        # Chunk 0 of rank r pairs with chunk 1 of rank 1 - r: 10 r + 0 + 10 (1 - r) + 1 = 11.
        assert sums == [11.0, 11.0]
