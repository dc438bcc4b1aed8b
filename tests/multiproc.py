"""The tests' multi-process harness: the runtime's forked-rank launcher, failing the way a
test should (AssertionError with every failing rank's traceback; WorkerTimeoutError naming
the ranks killed at the deadline)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from megatron_dualpipe.runtime.launch import LaunchFailure, run_ranks

__all__ = ["WorkerTimeoutError", "one_fast", "run_workers", "slow_unless"]


def slow_unless(
    fast: Callable[[Any], bool], values: Sequence[Any], ids: Callable[[Any], str] | None = None
) -> list[Any]:
    """``values`` as test parameters, those not ``fast`` marked ``slow``: the fast loop runs
    a few variants of a multi-process test, the full suite all of them."""
    return [
        pytest.param(v, marks=() if fast(v) else pytest.mark.slow, id=ids(v) if ids else None)
        for v in values
    ]


def one_fast(values: Sequence[Any], fast: Any) -> list[Any]:
    """``values`` as test parameters, every one but ``fast`` marked ``slow``."""
    return slow_unless(lambda v: v == fast, values)


class WorkerTimeoutError(AssertionError):
    """Raised when some ranks did not finish within the timeout (they were killed)."""


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 60.0,
    pg_timeout_s: float = 10.0,
    threads_per_worker: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks and return
    their results in rank order (see :func:`megatron_dualpipe.runtime.launch.run_ranks`)."""
    return run_ranks(
        fn,
        world_size,
        args=args,
        timeout_s=timeout_s,
        pg_timeout_s=pg_timeout_s,
        threads_per_rank=threads_per_worker,
        failure_as=_test_failure,
    )


def _test_failure(failure: LaunchFailure) -> AssertionError:
    """A rank that raised fails the test with its traceback; a hang names the ranks killed."""
    error = AssertionError if failure.errors else WorkerTimeoutError
    return error(str(failure))
