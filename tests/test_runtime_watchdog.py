"""Contract of the watchdog: a hang becomes an error on every rank that waits, naming the
rank, the action it waited on and the peer, within about one timeout."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch import nn

from megatron_dualpipe.runtime import (
    PipelineCommError,
    PipelineExecutor,
    PipelineWaitError,
    TensorSpec,
)
from megatron_dualpipe.runtime.p2p import PipeComm
from megatron_dualpipe.runtime.watchdog import Watchdog
from megatron_dualpipe.schedules.comm_plan import Comm, CommOp, Issue, Wait
from megatron_dualpipe.schedules.ir import Kind, Placement
from megatron_dualpipe.schedules.registry import generate
from tests.multiproc import run_workers

pytestmark = pytest.mark.multiproc

RANKS, MICROBATCHES, FAULTY_RANK = 4, 4, 1
TIMEOUT_S = 1.0
#: The crash's timeout: a dead peer is found through the broken connection, never by a
#: timeout, however long the ranks' compute takes on a loaded machine.
NO_TIMEOUT_S = 600.0


class Faulty(nn.Linear):
    """A stage that crashes, or stalls for ``2 x TIMEOUT_S``, on its second forward."""

    def __init__(self, fault: str):
        super().__init__(4, 4)
        self.fault = fault
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            if self.fault == "crash":
                raise RuntimeError("simulated crash")
            time.sleep(2 * TIMEOUT_S)
        return super().forward(x)


def run_with_fault(rank: int, world_size: int, fault: str, timeout_s: float) -> tuple[str, str]:
    """Run 1F1B with a fault on FAULTY_RANK; report (error type, message)."""
    module = Faulty(fault) if rank == FAULTY_RANK else nn.Linear(4, 4)
    executor = PipelineExecutor(
        generate("1f1b", world_size, MICROBATCHES),
        rank,
        [module],
        specs={s: TensorSpec((2, 4)) for s in range(world_size)},
        loss_fn=lambda out, mb: out.sum(),
        timeout_s=timeout_s,
    )
    try:
        executor.run([torch.ones(2, 4)] * MICROBATCHES)
    except Exception as error:  # report it, so that every rank's outcome comes back
        return type(error).__name__, str(error)
    return "", "finished"


_MESSAGE = re.compile(
    r"pipeline rank (\d) gave up on (.+) \(peer: rank (\d)\) after ([\d.]+) s: (.*)", re.S
)


def _waits(outcomes: list[tuple[str, str]]) -> list[tuple[float, str]]:
    """How long each rank but the faulty one waited on a neighbour (as its watchdog measured
    the wait: the rank's compute before it, longer on a loaded machine, does not count) and
    what it gave up for (its message names the rank, the action and the peer)."""
    waits = []
    for rank, (kind, message) in enumerate(outcomes):
        if rank == FAULTY_RANK:
            continue
        assert kind == PipelineWaitError.__name__, f"rank {rank}: {kind}: {message}"
        match = _MESSAGE.match(message)
        assert match, message
        assert int(match.group(1)) == rank
        assert re.search(r"\d+(RECV_F|RECV_B|SEND_F|SEND_B)\d+", match.group(2)), message
        assert int(match.group(3)) in (rank - 1, rank + 1), message
        waits.append((float(match.group(4)), match.group(5)))
    return waits


def test_a_dead_peer_fails_every_waiting_rank_at_once() -> None:
    """Through the broken connection, not a timeout (the crash's is 10 minutes, and the
    launcher's 30 s bound would fail the test first)."""
    outcomes = run_workers(run_with_fault, RANKS, args=("crash", NO_TIMEOUT_S), timeout_s=30)
    assert outcomes[FAULTY_RANK] == ("RuntimeError", "simulated crash")
    for _, cause in _waits(outcomes):
        assert cause.startswith("the connection broke, the peer has probably died"), cause


@pytest.mark.slow
def test_a_receive_that_never_arrives_fails_every_waiting_rank_within_the_timeout() -> None:
    """The stalled rank's neighbour by its 1 s timeout, the others then through the
    connections that its failure broke."""
    outcomes = run_workers(run_with_fault, RANKS, args=("stall", TIMEOUT_S), timeout_s=30)
    waits = _waits(outcomes)
    assert all(waited < TIMEOUT_S + 1.0 for waited, _ in waits), waits
    assert any(c.startswith("no progress within the 1 s timeout") for _, c in waits), waits


# The first lines of what gloo raises in each case (torch 2.13).
_GLOO_ERRORS = {
    "local": "input tensor has to be contiguous",
    "peer lost": "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5810.",
    "timeout": "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1000ms for recv",
}


@pytest.mark.parametrize(
    ("case", "error", "cause"),
    [
        ("local", PipelineCommError, "the communication backend failed on this rank"),
        ("peer lost", PipelineWaitError, "the connection broke, the peer has probably died"),
        ("timeout", PipelineWaitError, "no progress within the 1 s timeout"),
    ],
)
def test_only_a_broken_connection_is_blamed_on_the_peer(case, error, cause) -> None:
    with pytest.raises(PipelineCommError) as raised, Watchdog(0, TIMEOUT_S).guard("0SEND_F0", 1):
        raise RuntimeError(_GLOO_ERRORS[case])
    assert type(raised.value) is error
    assert str(raised.value.__cause__) == _GLOO_ERRORS[case]  # the backend's error is kept
    message = str(raised.value)
    assert message.startswith("pipeline rank 0 ") and "0SEND_F0 (peer: rank 1)" in message
    assert f"{cause} ({_GLOO_ERRORS[case]})" in message


class _NeverReceived:
    """A send whose receiver never posts its receive: it completes only when released."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.released.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("Timed out waiting for send")
        return True

    def is_completed(self) -> bool:
        return self.released.is_set()


class _SilentPeer:
    """A gloo-like transport (waits with a deadline on the host) whose peer never answers."""

    host_waits = "timed"

    def __init__(self) -> None:
        self.works: list[_NeverReceived] = []

    def setup(self, comm, rank, peers, watchdog) -> None:
        return None

    def start(self, comm, ops) -> list[_NeverReceived]:
        self.works += [_NeverReceived() for _ in ops]
        return self.works[-len(ops) :]

    def abort(self) -> None:
        return None

    def close(self) -> None:
        return None


def test_a_send_never_received_is_named_as_a_wait_that_timed_out() -> None:
    """A send the peer never receives fails in the sentence of every other wait: the
    message's name alone after "gave up on", then the timeout (the launcher's pattern)."""
    placement = Placement("loop", 2, 2, 1)
    transport = _SilentPeer()
    comm = PipeComm(
        placement, 0, {(Kind.RECV_B, 0): (TensorSpec((2,)),)}, Watchdog(0, 0.2), transport
    )
    key = (Kind.RECV_F, 1, 0)
    send = CommOp("send", 1, Comm("F", (0, 1)), key)
    comm.issue(Issue((send,)), {key: (torch.ones(2),)})
    start = time.monotonic()
    try:
        with pytest.raises(PipelineWaitError) as raised:
            comm.wait(Wait((key,)))
    finally:
        for work in transport.works:
            work.released.set()
        comm.close()
    assert time.monotonic() - start < 10.0  # it gives up, however loaded the machine
    assert _MESSAGE.match(str(raised.value)), raised.value
    said = re.fullmatch(
        r"pipeline rank 0 gave up on \S+ \(peer: rank 1\) after (\d+\.\d) s: no progress "
        r"within the 0\.2 s timeout \(Timed out waiting for send\)",
        str(raised.value),
    )
    assert said and float(said[1]) >= 0.2, raised.value  # 0.3 s seen on a loaded machine
