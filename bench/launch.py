"""The benchmark's ranks: forked CPU+gloo processes (the runtime's launcher) whose failure
is a :class:`BenchError`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatron_dualpipe.errors import DualPipeError
from megatron_dualpipe.runtime import launch

__all__ = ["BenchError", "run_ranks"]


class BenchError(DualPipeError, RuntimeError):
    """A benchmark run failed: a rank raised, exited silently or overran its deadline."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 20.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks; return
    their (picklable) results in rank order, or raise :class:`BenchError`."""
    return launch.run_ranks(
        fn,
        world_size,
        args=args,
        timeout_s=timeout_s,
        pg_timeout_s=pg_timeout_s,
        failure_as=lambda failure: BenchError(failure.first),
    )
