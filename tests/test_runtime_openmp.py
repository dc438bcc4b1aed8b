"""A process forked after a parallel region runs parallel regions of its own.

CI's full suite hung (pytest's 300 s timeout) in a one-rank ``train`` forked from the pytest
process after earlier tests had run torch ops on two intra-op threads: the rank waited in
``gomp_team_barrier_wait_end`` under its first ``torch.zeros``. ``fork_child_finishes`` shows
the hazard in this torch build and the release that removes it, each in a fresh interpreter;
the launcher test shows :func:`run_ranks` releases the pool itself.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_dualpipe.runtime.launch import run_ranks
from megatron_dualpipe.runtime.openmp import loaded_libgomp, release_thread_pool

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.skipif(not loaded_libgomp(), reason="this torch does not use GNU libgomp"),
]

#: Elements enough for torch to split a fill over two threads (its grain size is 32,768).
PARALLEL = 1 << 20


def _fork_child_finishes(release: bool) -> bool:
    """In a fresh interpreter: a parallel region on two threads, the release or not, a fork,
    then the same region in the child; whether the child finished within 5 s (it takes
    well under one)."""
    program = textwrap.dedent(f"""
        import os, sys, time, torch
        from megatron_dualpipe.runtime.openmp import release_thread_pool
        torch.set_num_threads(2)
        torch.zeros({PARALLEL})
        if {release!r}:
            assert release_thread_pool()
        pid = os.fork()
        if pid == 0:
            torch.zeros({PARALLEL})
            os._exit(0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                sys.exit(0)
            time.sleep(0.05)
        os.kill(pid, 9)
        sys.exit(3)
    """)
    done = subprocess.run([sys.executable, "-c", program], timeout=120, capture_output=True)
    assert done.returncode in (0, 3), done.stderr.decode()
    return done.returncode == 0


@pytest.mark.slow
def test_a_child_forked_after_a_parallel_region_hangs_in_its_own() -> None:
    """The hazard itself: should a torch release stop it, the release may go."""
    assert not _fork_child_finishes(release=False)


@pytest.mark.slow
def test_the_release_lets_the_forked_child_run_in_parallel() -> None:
    assert _fork_child_finishes(release=True)


def _parallel_fill(rank: int, world_size: int) -> int:
    return int(torch.ones(PARALLEL).sum().item())


def test_ranks_forked_after_a_parallel_region_run_parallel_ops() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.zeros(PARALLEL)  # this process's pool: what the ranks must not inherit
        results = run_ranks(_parallel_fill, 1, threads_per_rank=2, timeout_s=30.0)
    finally:
        torch.set_num_threads(threads)
    assert results == [PARALLEL]


def test_the_release_is_repeatable_and_the_pool_comes_back() -> None:
    torch.zeros(PARALLEL)
    assert release_thread_pool() and release_thread_pool()
    assert torch.ones(PARALLEL).sum().item() == PARALLEL
