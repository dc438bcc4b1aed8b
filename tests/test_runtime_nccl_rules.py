"""The executor under NCCL's rules, on CPU.

- It issues exactly its communication plan: every call it hands a transport (communicator,
  operations in order) and every receive it waits on, recorded on gloo for every
  registered schedule at PP 2 and 4, equal the plan built from the schedule.
- The NCCL-rules emulation (all of a rank's communicators on one stream, sends that
  complete only once their receive has started) runs the shipped lock-step plan; two
  ranks that each send before they receive, in batches of their own, hang there, and each
  rank's hang monitor turns that into an error naming the rank within its timeout, while
  the same batches finish with a stream per communicator.
- The emulation gives the losses and gradients of the pipeline group's own transport
  (what NCCL gets too: one ``batch_isend_irecv`` per batch), bit for bit.
- The hang monitor: an operation pending past the timeout is named and the transport
  aborted; completed ones are forgotten.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_dualpipe.runtime import PipelineExecutor, PipelineWaitError, TensorSpec
from megatron_dualpipe.runtime.transport import ElementOp, GroupTransport
from megatron_dualpipe.runtime.watchdog import HangMonitor, Watchdog
from megatron_dualpipe.schedules.comm_plan import Comm, CommOp, Issue, Wait, comm_plan, key_text
from megatron_dualpipe.schedules.ir import Kind
from megatron_dualpipe.schedules.registry import SCHEDULES, generate, spec
from tests.multiproc import run_workers
from tests.nccl_emulation import NcclRulesTransport

pytestmark = pytest.mark.multiproc

HIDDEN, BATCH = 4, 2
TIMEOUT_S = 20.0


def _stages(schedule) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(HIDDEN, HIDDEN) for _ in range(schedule.placement.num_model_stages)]


def _run(rank: int, name: str, microbatches: int, transport_kind: str, **executor_options):
    """One training step of a tiny linear model; returns (losses, grads, transport)."""
    world = dist.get_world_size()
    options = {"chunks": 2} if spec(name).chunks is None else {}
    schedule = generate(name, world, microbatches, **options)
    p = schedule.placement
    stages = _stages(schedule)
    # The same seed everywhere: DualPipe's two copies of a stage start equal.
    modules = [stages[p.model_stage(p.stage_of(rank, c))] for c in range(p.num_chunks)]
    ranks = list(range(world))
    transport = None
    if transport_kind == "recorded-gloo":
        transport = _Recording(GroupTransport(dist.group.WORLD, ranks))
    elif transport_kind == "recorded-emulation":
        transport = _Recording(NcclRulesTransport(dist.group.WORLD, ranks))
    elif transport_kind == "emulation":
        transport = NcclRulesTransport(dist.group.WORLD, ranks)
    executor = PipelineExecutor(
        schedule,
        rank,
        modules,
        specs={s: TensorSpec((BATCH, HIDDEN)) for s in range(p.num_stages)},
        loss_fn=lambda out, mb: out.square().mean(),
        transport=transport,
        timeout_s=executor_options.pop("timeout_s", TIMEOUT_S),
        **executor_options,
    )
    inputs = [torch.full((BATCH, HIDDEN), float(m + 1)) for m in range(microbatches)]
    try:
        result = executor.run(inputs)
    finally:
        executor.close()
    grads = [p.grad.clone() for m in modules for p in m.parameters()]
    return result.losses, grads, transport


class _Recording:
    """A transport that records what the executor hands it and which receives it waits
    on (in order), passing everything through."""

    def __init__(self, inner):
        self.inner = inner
        self.host_waits = inner.host_waits
        self.issued: list[tuple] = []
        self.waited: list[tuple] = []

    def setup(self, comm, rank, peers, watchdog):
        self.inner.setup(comm, rank, peers, watchdog)

    def start(self, comm, ops):
        self.issued.append((comm, [(o.op.kind, o.op.peer, o.op.key, o.element) for o in ops]))
        handles = self.inner.start(comm, ops)
        return [_RecordedWork(h, o.op, self.waited) for h, o in zip(handles, ops, strict=True)]

    def abort(self):
        self.inner.abort()

    def close(self):
        self.inner.close()

    def __getstate__(self):  # what comes back to the test
        return {"issued": self.issued, "waited": self.waited}

    def __setstate__(self, state):
        self.__dict__.update(state)


class _RecordedWork:
    def __init__(self, inner, op, waited):
        self._inner, self._op, self._waited = inner, op, waited

    def wait(self, *args):
        if self._op.kind == "recv" and threading.current_thread() is threading.main_thread():
            self._waited.append(self._op.key)
        return self._inner.wait(*args)

    def is_completed(self):
        return self._inner.is_completed()


def _record(rank: int, world: int, transport_kind: str) -> list:
    return [
        (name, _run(rank, name, 2 * spec(name).min_microbatches(world), transport_kind)[2])
        for name in SCHEDULES
    ]


@pytest.mark.parametrize(
    ("world", "transport_kind"),
    [
        (2, "recorded-gloo"),
        (2, "recorded-emulation"),
        pytest.param(4, "recorded-gloo", marks=pytest.mark.slow),
        pytest.param(4, "recorded-emulation", marks=pytest.mark.slow),
    ],
)
def test_the_executor_issues_exactly_its_plan(world: int, transport_kind: str) -> None:
    recorded = run_workers(_record, world, args=(transport_kind,), timeout_s=120)
    for rank, per_schedule in enumerate(recorded):
        for name, transport in per_schedule:
            options = {"chunks": 2} if spec(name).chunks is None else {}
            schedule = generate(name, world, 2 * spec(name).min_microbatches(world), **options)
            steps = comm_plan(schedule).comm_steps(rank)
            issued = [
                (s.comm, [(o.kind, o.peer, o.key, 0) for o in s.ops])
                for s in steps
                if isinstance(s, Issue)
            ]
            mine = {o.key for s in steps if isinstance(s, Issue) for o in s.ops if o.kind == "recv"}
            waited = [k for s in steps if isinstance(s, Wait) for k in s.keys if k in mine]
            assert transport.issued == issued, f"{name} rank {rank}: issued"
            assert transport.waited == waited, f"{name} rank {rank}: waited"


def _compare(rank: int, world: int, name: str, microbatches: int, kind: str) -> bool:
    """Whether ``kind``'s losses and gradients equal the pipeline group's, exactly."""
    ours = _run(rank, name, microbatches, kind)
    plain = _run(rank, name, microbatches, "gloo")
    same_losses = ours[0].keys() == plain[0].keys() and all(
        torch.equal(ours[0][m], plain[0][m]) for m in plain[0]
    )
    return same_losses and all(torch.equal(a, b) for a, b in zip(ours[1], plain[1], strict=True))


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_the_emulation_computes_what_the_pipeline_group_does(name):
    assert all(run_workers(_compare, 2, args=(name, 4, "emulation"), timeout_s=120))


HANG_TIMEOUT_S = 1.0


def _send_then_receive(rank: int, world: int, streams: str) -> tuple[str, str, list[float]]:
    """Ranks 0 and 1 each issue a send to the other, then the matching receive, each a
    batch of its own on a two-rank communicator per direction, watched by a hang monitor
    that aborts the transport past its timeout; the outcome, the monitor's verdict and
    what was received. Both ranks meet on a group of their own before either returns: a
    rank that left first would fail its peer's blocked operations before its monitor
    spoke."""
    done = dist.new_group(backend="gloo")
    transport = NcclRulesTransport(dist.group.WORLD, [0, 1], streams=streams)
    peer = 1 - rank
    keys = [(Kind.RECV_F, 1, 0), (Kind.RECV_F, 1, 1)]  # rank 0's message, rank 1's
    mine, theirs = keys[rank], keys[peer]
    sent, received = torch.full((2,), rank + 1.0), torch.zeros(2)
    out, into = Comm("F", (rank, peer)), Comm("F", (peer, rank))
    batches = [
        (out, ElementOp(CommOp("send", peer, out, mine), 0, sent, 10 * (rank + 1))),
        (into, ElementOp(CommOp("recv", peer, into, theirs), 0, received, 10 * (peer + 1))),
    ]
    monitor = HangMonitor(Watchdog(rank, HANG_TIMEOUT_S), transport.abort, poll_s=0.01)
    outcome, verdict = "finished", ""
    try:
        works = [(transport.start(comm, [op])[0], op) for comm, op in batches]
        for work, op in works:
            monitor.watch(work, key_text(op.op.key), peer)
            monitor.waiting(work)
        for work, _ in works:
            work.wait()
    except RuntimeError as error:
        outcome = str(error)
        try:
            monitor.check()
        except PipelineWaitError as named:
            verdict = str(named)
    finally:
        monitor.close()
        transport.close()
    dist.barrier(group=done)
    return outcome, verdict, received.tolist()


@pytest.mark.slow
def test_a_cycle_through_one_stream_hangs_the_emulation_until_the_hang_monitor_aborts() -> None:
    """Each rank's send waits for its receive to start (NCCL's rendezvous), and on one
    shared stream each rank's receive is queued behind its own send: both hang until
    each rank's monitor aborts and names the message. With a stream per communicator
    (what a two-rank-channel design needs) the same batches finish."""
    outcomes = run_workers(_send_then_receive, 2, args=("shared",), timeout_s=60)
    for rank, (outcome, verdict, _) in enumerate(outcomes):
        assert outcome == "the pipeline's communicators were aborted", f"rank {rank}: {outcome}"
        assert verdict.startswith(f"pipeline rank {rank} gave up on "), verdict
        assert f"(peer: rank {1 - rank})" in verdict and "hang monitor" in verdict, verdict
    runs = run_workers(_send_then_receive, 2, args=("distinct",), timeout_s=60)
    assert runs == [("finished", "", [2.0, 2.0]), ("finished", "", [1.0, 1.0])]


class _Pending:
    def __init__(self, completed: bool = False):
        self.completed = completed

    def is_completed(self) -> bool:
        return self.completed


def test_the_hang_monitor_names_an_operation_pending_past_its_timeout() -> None:
    aborted = threading.Event()
    monitor = HangMonitor(Watchdog(3, 0.3), aborted.set, poll_s=0.01)
    try:
        done, stuck = _Pending(completed=True), _Pending()
        monitor.watch(done, "2RECV_F0", 2)
        monitor.watch(stuck, "2RECV_B1", 4)
        monitor.waiting(stuck)
        assert aborted.wait(5), "the monitor never aborted"
        assert monitor.watching == 1  # the completed one was forgotten
        with pytest.raises(PipelineWaitError) as raised:
            monitor.check()
        message = str(raised.value)
        assert message.startswith("pipeline rank 3 gave up on 2RECV_B1 (peer: rank 4) after ")
        assert "no progress within the 0.3 s timeout" in message
    finally:
        monitor.close()


class _Clock:
    """Seconds that pass only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_hang_monitors_clock_starts_at_the_wait_not_at_the_issue() -> None:
    """A receive posted early (at its Issue, long before the compute that needs it) and
    waited within the timeout is no hang; one the rank waits on past the timeout is."""
    aborted = threading.Event()
    clock = _Clock()
    # The thread never polls on its own here (poll_s: an hour): the test polls.
    monitor = HangMonitor(Watchdog(1, 10.0), aborted.set, poll_s=3600, clock=clock)
    try:
        early, late = _Pending(), _Pending()
        monitor.watch(early, "1RECV_F3", 0)  # issued at 100 s
        clock.now += 60.0  # six timeouts of compute before its Wait
        assert monitor.poll() and not aborted.is_set()
        monitor.waiting(early)  # waited at 160 s
        clock.now += 9.0
        assert monitor.poll() and not aborted.is_set()
        early.completed = True  # arrived 9 s into its wait: within the timeout
        monitor.watch(late, "1RECV_B2", 2)
        monitor.waiting(late)
        monitor.waiting(late)  # a second wait does not restart its clock
        clock.now += 5.0
        assert monitor.poll() and monitor.watching == 1  # the early one is forgotten
        clock.now += 5.0
        assert not monitor.poll() and aborted.is_set()
        with pytest.raises(
            PipelineWaitError, match=r"rank 1 gave up on 1RECV_B2 \(peer: rank 2\) after 10.0 s"
        ):
            monitor.check()
    finally:
        monitor.close()


def test_the_hang_monitor_leaves_operations_that_complete_in_time_alone() -> None:
    aborted = threading.Event()
    monitor = HangMonitor(Watchdog(0, 0.5), aborted.set, poll_s=0.01)
    try:
        work = _Pending()
        monitor.watch(work, "1RECV_F0", 1)
        monitor.waiting(work)
        time.sleep(0.2)
        work.completed = True
        time.sleep(0.5)
        assert not aborted.is_set() and monitor.error is None and monitor.watching == 0
    finally:
        monitor.close()


class _Counted(_Pending):
    """A pending operation that counts its ``is_completed()`` calls (each one a CUDA event
    query on NCCL)."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = 0

    def is_completed(self) -> bool:
        self.queries += 1
        return super().is_completed()


def test_the_hang_monitor_queries_nothing_while_paused() -> None:
    """While ``paused`` says so (Megatron's ``is_graph_capturing`` under the adapter: TE
    captures in global mode, where another thread's event query breaks the capture) the
    monitor queries no operation and reports nothing; then it goes on as before."""
    aborted = threading.Event()
    clock = _Clock()
    capturing = [True]
    monitor = HangMonitor(
        Watchdog(0, 1.0), aborted.set, poll_s=3600, clock=clock, paused=lambda: capturing[0]
    )
    try:
        work = _Counted()
        monitor.watch(work, "0RECV_F1", 1)
        monitor.waiting(work)
        clock.now += 5.0
        assert monitor.poll() and work.queries == 0 and not aborted.is_set()
        capturing[0] = False
        assert not monitor.poll() and work.queries == 1 and aborted.is_set()
    finally:
        monitor.close()
