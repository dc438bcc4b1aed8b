"""Run a function on N forked CPU+gloo ranks, with a deadline, and collect their results.

Forked, not spawned: the parent imports torch (and whatever the workers need) once, and
each worker starts from that state in well under a second. Rank 0 hosts the rendezvous
store (the parent must not run a store thread while it forks). Every worker gets
``torch.set_num_threads(1)`` and a gloo process group with a short timeout, so a lost peer
turns into an error rather than a hang. At the deadline, or shortly after the first
failure, every worker still running is killed (SIGKILL to its own process group) and
:class:`BenchError` names the ranks; no worker outlives the call.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["BenchError", "run_ranks"]

_HOST = "127.0.0.1"
_GRACE_S = 2.0  # after a first failure, how long the others get to report theirs


class BenchError(RuntimeError):
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
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs, conns = [], {}
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                args=(send_end, fn, rank, world_size, tuple(args), port, pg_timeout_s),
                name=f"bench-rank{rank}",
            )
            proc.start()
            send_end.close()
            with contextlib.suppress(OSError):
                os.setpgid(proc.pid, proc.pid)
            procs.append(proc)
            conns[recv_end] = rank
        results, errors, pending = _collect(conns, time.monotonic() + timeout_s)
    finally:
        for proc in procs:
            _kill(proc.pid)
        for proc in procs:
            proc.join()
        for conn in conns:
            conn.close()
    if errors:
        rank, text = errors[0]
        raise BenchError(f"rank {rank} of {world_size} failed:\n{text}")
    if pending:
        raise BenchError(
            f"ranks {pending} of {world_size} did not finish within {timeout_s:.0f} s and "
            "were killed"
        )
    return [results[r] for r in range(world_size)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return sock.getsockname()[1]


def _collect(
    conns: dict[Any, int], deadline: float
) -> tuple[dict[int, Any], list[tuple[int, str]], list[int]]:
    """Wait (idle) for one report per rank until all came, the deadline, or a failure."""
    results: dict[int, Any] = {}
    failed: list[tuple[float, int, str]] = []
    pending = dict(conns)
    while pending and (remaining := deadline - time.monotonic()) > 0:
        for conn in multiprocessing.connection.wait(list(pending), timeout=remaining):
            rank = pending.pop(conn)
            try:
                ok, payload, when = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                ok, payload, when = False, "exited without reporting", time.monotonic()
            if ok:
                results[rank] = payload
            else:
                failed.append((when, rank, payload))
        if failed:
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    errors = [(rank, text) for _, rank, text in sorted(failed)]
    return results, errors, sorted(pending.values())


def _worker(conn, fn, rank, world_size, args, port, pg_timeout_s) -> None:
    """One rank: set up gloo, run ``fn``, report (ok, result, time), leave by ``os._exit``."""
    code = 1
    try:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{_HOST}:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
            result = fn(rank, world_size, *args)
            dist.destroy_process_group()
            message = (True, result, time.monotonic())
        except BaseException:
            message = (False, traceback.format_exc(), time.monotonic())
        try:
            data = pickle.dumps(message)
        except Exception:
            data = pickle.dumps((False, traceback.format_exc(), time.monotonic()))
        conn.send_bytes(data)
        conn.close()
        code = 0
    finally:
        os._exit(code)


def _kill(pid: int | None) -> None:
    """SIGKILL a worker's process group and the worker itself (already gone: no-op)."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
