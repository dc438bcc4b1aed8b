"""A rank that dies is noticed at once, named, and takes every other process with it.

The runtime's forked-rank launcher watches each rank's process, not only its result pipe:
a child the rank forked (dist_checkpointing's writer processes are such children) keeps a
copy of the pipe's write end, so the pipe alone would not close when the rank dies. Each
test kills for real (SIGKILL) and is bounded in time, so a regression fails instead of
hanging.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_dualpipe.runtime.launch import LaunchFailure, run_ranks

#: Long enough that only the launcher's own detection can end the call in time.
PG_TIMEOUT_S = 120.0
#: Every rank must be gone this soon after one died.
STOP_WITHIN_S = 5.0


def _die_with_a_child_holding_the_pipe(rank: int, world_size: int, pid_file: str) -> int:
    """Rank 1 forks a child (it inherits every fd, the result pipe included), then is
    killed with SIGKILL; rank 0 waits in a collective the dead rank never joins."""
    if rank == 1:
        child = os.fork()
        if child == 0:  # the "writer": outlives its parent unless someone kills it
            time.sleep(600)
            os._exit(0)
        Path(pid_file).write_text(f"{child} {time.monotonic()}")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return rank


def test_a_rank_killed_while_its_child_holds_the_pipe_is_named_within_seconds(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "child"
    with pytest.raises(LaunchFailure) as info:
        run_ranks(
            _die_with_a_child_holding_the_pipe,
            2,
            args=(str(pid_file),),
            timeout_s=60,
            pg_timeout_s=PG_TIMEOUT_S,
        )
    stopped = time.monotonic()
    child, killed_at = pid_file.read_text().split()
    assert stopped - float(killed_at) < STOP_WITHIN_S
    failure = info.value
    assert failure.errors[0][:2] == (1, "died"), failure
    assert failure.first.startswith("rank 1 of 2 failed: it was killed by SIGKILL, signal 9")
    assert _gone_soon([int(child)]) == []  # the orphaned child went with its rank


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie left for init to reap is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone_soon(pids: list[int], within_s: float = 1.0) -> list[int]:
    """The pids still running after ``within_s`` (SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + within_s
    while True:
        left = [pid for pid in pids if _running(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)
