"""Contracts of the multi-process harness: ordered results, failures surface, hangs die."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_dualpipe.runtime.launch import LaunchFailure, TempDirTooLong, run_ranks
from tests.multiproc import WorkerTimeoutError, run_workers

pytestmark = pytest.mark.multiproc


def _rank_info(rank: int, world_size: int, scale: int) -> tuple[int, int, int, float]:
    # Stagger the finish so arrival order differs from rank order.
    time.sleep(0.05 * (world_size - rank))
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, world_size, rank * scale, total.item()


def _fail_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.all_reduce(torch.ones(1))  # the peers fail too, as they would in a real run
    return rank


def _hang_on_rank(rank: int, world_size: int, bad_rank: int, pid_file: str) -> int:
    if rank == bad_rank:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
    return rank


def test_results_come_back_in_rank_order() -> None:
    results = run_workers(_rank_info, 4, args=(10,), timeout_s=30)
    assert results == [(r, 4, 10 * r, 6.0) for r in range(4)]


def test_raising_worker_fails_the_call_with_its_traceback() -> None:
    with pytest.raises(AssertionError) as info:
        run_workers(_fail_on_rank, 3, args=(1,), timeout_s=30)
    headline, *details = str(info.value).splitlines()
    # The root cause leads, with its traceback; the peers' broken connections follow.
    assert "first rank 1: ValueError: deliberate failure on rank 1" in headline
    assert details[0] == "--- rank 1 (error) ---"
    assert 'raise ValueError(f"deliberate failure on rank {rank}")' in "\n".join(details)


#: Long enough for the rank that does not hang to start and finish on a loaded machine (at
#: 1 s, both ranks were named once while a second suite ran beside CI).
HANG_TIMEOUT_S = 10.0


@pytest.mark.slow
def test_hanging_worker_is_killed_within_the_timeout(tmp_path) -> None:
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"ranks \[1\] of 2 did not finish"):
        run_workers(_hang_on_rank, 2, args=(1, str(pid_file)), timeout_s=HANG_TIMEOUT_S)
    assert time.monotonic() - start < HANG_TIMEOUT_S + 5
    hung_pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(hung_pid, 0)  # killed and reaped, not left behind


def _listening_addresses(rank: int, world_size: int) -> list[str]:
    import psutil

    dist.all_reduce(torch.ones(1))  # every rank has joined: the store and gloo are up
    connections = psutil.Process().net_connections("tcp")
    return sorted({c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN})


def test_the_ranks_listen_on_the_loopback_address_alone() -> None:
    """Rank 0 hosts the rendezvous store: torch's own binds every interface of the machine
    (it accepted connections on its external addresses)."""
    assert run_workers(_listening_addresses, 2) == [["127.0.0.1"], ["127.0.0.1"]]


def _stop_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    import signal

    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGSTOP)  # hung, not dead: nothing tells the launcher
    dist.all_reduce(torch.ones(1))
    return rank


@pytest.mark.slow
def test_a_stopped_rank_is_named_when_its_peers_give_up() -> None:
    from megatron_dualpipe.runtime.launch import LaunchFailure, run_ranks

    with pytest.raises(LaunchFailure) as info:
        run_ranks(_stop_on_rank, 2, args=(1,), timeout_s=60, pg_timeout_s=1.0)
    failure = info.value
    assert failure.stopped == [1] and failure.errors[0][0] == 0, failure
    assert failure.first.endswith(
        "(rank 1 was stopped, by SIGSTOP or a debugger, and never answered)"
    )


class _Stopped(Exception):
    """What the test's SIGTERM handler raises (a launcher's caller unwinding on SIGTERM)."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped(signum)


def test_one_line_for_a_launch_says_an_error_every_rank_had_once() -> None:
    same = LaunchFailure(2, [(1, "error", "found NaN"), (0, "error", "found NaN")], [], None)
    assert same.cause == "found NaN"
    died = [(1, "died", "it was killed by SIGKILL"), (0, "error", "Traceback ...")]
    assert LaunchFailure(2, died, [], None).cause == "rank 1 of 2 failed: it was killed by SIGKILL"
    one = LaunchFailure(2, [(1, "error", "found NaN")], [0], None)  # rank 0 was killed
    assert one.cause == "rank 1 of 2 failed: found NaN"


def test_stop_signals_wait_for_the_launch_clean_up_to_end() -> None:
    """A second SIGTERM while the ranks are killed and the run's folder removed is held,
    and raised again once that is done (it cut the removal short, leaving the folder)."""
    from megatron_dualpipe.runtime.launch import _stop_signals_held

    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    done = []
    try:
        with pytest.raises(_Stopped), _stop_signals_held():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
            done.append("the clean-up ran to its end")
        assert done == ["the clean-up ran to its end"]
        assert signal.getsignal(signal.SIGTERM) is _raise_stopped
    finally:
        signal.signal(signal.SIGTERM, previous)


def _touch(rank: int, world_size: int, folder: str) -> None:
    Path(folder, f"rank{rank}").touch()


def test_a_long_tmpdir_is_one_sentence_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks' sockets (a checkpoint writer's result-queue manager, torch's tensor
    sharing) live under the run's folder in TMPDIR: over 36 characters a save failed in a
    worker with "AF_UNIX path too long" and the run with a bare EOFError."""
    temp = tmp_path / ("t" * max(1, 48 - len(str(tmp_path))))
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with pytest.raises(TempDirTooLong) as info:
        run_ranks(_touch, 2, args=(str(tmp_path),))
    assert str(info.value) == (
        f"TMPDIR {temp} is {len(str(temp))} characters long, and the ranks' sockets live under "
        "it, which leaves it at most 36 (an AF_UNIX socket path is at most 107 bytes): set "
        "TMPDIR to a shorter directory, such as /tmp"
    )
    assert not list(tmp_path.glob("rank*"))  # no rank started
