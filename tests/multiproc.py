"""Run a function on N forked gloo ranks and collect what each returns.

Workers are forked, not spawned: a test module imports torch and megatron once, and
every worker starts from that state in about a second instead of re-importing.

Rank 0 hosts the rendezvous TCPStore on a port the parent picked (bound to port 0 by
the OS, never handed out twice in one session). The parent must not host the store
itself: forking while its server thread runs deadlocks a child now and then. The rare
loss of the picked port to another process between pick and bind shows up as a
failure before ``fn`` starts, and the launch is retried on a fresh port.

A call never hangs: at ``timeout_s`` every worker still running is killed with SIGKILL
together with its process group, and the call fails naming those ranks.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["WorkerTimeoutError", "run_workers"]

_HOST = "127.0.0.1"
# After the first failure, how long the other ranks get to report their own error
# (usually a broken connection) before they are killed.
_FAILURE_GRACE_S = 1.0
# Launch attempts when a rank fails before ``fn`` starts (rendezvous trouble).
_LAUNCH_ATTEMPTS = 3
_ports_handed_out: set[int] = set()


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
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks.

    Each worker has the default process group initialised (gloo, ``pg_timeout_s``) before
    ``fn`` runs and destroyed after it. Returns the workers' return values in rank
    order; they must be picklable.

    Raises AssertionError with the formatted traceback of every rank that raised (the
    first to fail listed first), and WorkerTimeoutError (an AssertionError) naming the
    ranks still running after ``timeout_s``; those are killed with SIGKILL along with
    their process groups. No worker outlives the call.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, _LAUNCH_ATTEMPTS + 1):
        results, errors, unfinished = _launch(
            fn, world_size, tuple(args), deadline, pg_timeout_s, threads_per_worker
        )
        setup_failed = errors and all(kind == "setup" for _, kind, _ in errors)
        if not (setup_failed and attempt < _LAUNCH_ATTEMPTS and time.monotonic() < deadline):
            break
        print(
            f"run_workers: rendezvous failed (attempt {attempt}), retrying on a new port",
            file=sys.stderr,
        )

    if errors:
        first_rank, _, first_text = errors[0]
        summary = first_text.strip().splitlines()[-1] if first_text.strip() else "?"
        parts = [f"--- rank {rank} ({kind}) ---\n{text}" for rank, kind, text in errors]
        if unfinished:
            parts.append(f"(ranks {unfinished} were killed after the first failure)")
        raise AssertionError(
            f"{len(errors)} of {world_size} workers failed, first rank {first_rank}: {summary}\n"
            + "\n".join(parts)
        )
    if unfinished:
        raise WorkerTimeoutError(
            f"ranks {unfinished} of {world_size} did not finish within {timeout_s:.1f} s "
            "and were killed"
        )
    return [results[rank] for rank in range(world_size)]


def _launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    deadline: float,
    pg_timeout_s: float,
    threads_per_worker: int,
) -> tuple[dict[int, Any], list[tuple[int, str, str]], list[int]]:
    """Fork the workers once, collect their reports, and leave none running."""
    ctx = multiprocessing.get_context("fork")
    port = _pick_port()
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: dict[Any, int] = {}
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    send_end,
                    os.getpid(),
                    fn,
                    rank,
                    world_size,
                    args,
                    port,
                    pg_timeout_s,
                    threads_per_worker,
                ),
                name=f"rank{rank}",
            )
            proc.start()
            send_end.close()
            _set_own_process_group(proc.pid)
            procs.append(proc)
            conns[recv_end] = rank
        return _collect(conns, deadline)
    finally:
        for proc in procs:
            _kill_tree(proc)
        for proc in procs:
            proc.join()
            proc.close()
        for conn in conns:
            conn.close()


def _pick_port() -> int:
    """A port free right now that this process has not handed out before."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((_HOST, 0))
            port = sock.getsockname()[1]
        if port not in _ports_handed_out:
            _ports_handed_out.add(port)
            return port


def _collect(
    conns: dict[Any, int], deadline: float
) -> tuple[dict[int, Any], list[tuple[int, str, str]], list[int]]:
    """Read one report per worker until all reported, the deadline, or a failure.

    Errors are (rank, kind, text), kind "setup" (before ``fn`` ran) or "error", in the
    order the ranks failed (a rank's own clock reading), so the root cause comes first
    and the peers it disconnected follow."""
    results: dict[int, Any] = {}
    failed: list[tuple[float, int, str, str]] = []
    pending = dict(conns)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for conn in multiprocessing.connection.wait(list(pending), timeout=remaining):
            rank = pending.pop(conn)
            try:
                status, payload, when = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                status, payload = "error", "worker exited without reporting a result"
                when = time.monotonic()
            if status == "ok":
                results[rank] = payload
            else:
                failed.append((when, rank, status, payload))
        if failed:
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    errors = [(rank, kind, text) for _, rank, kind, text in sorted(failed)]
    return results, errors, sorted(pending.values())


def _worker_main(
    conn: multiprocessing.connection.Connection,
    parent_pid: int,
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    port: int,
    pg_timeout_s: float,
    threads_per_worker: int,
) -> None:
    """Body of one forked worker: report ("ok", result, t) or (kind, traceback, t) and
    leave by os._exit, so no inherited pytest or atexit machinery runs a second time.

    A failure is reported before the process group goes down, so peers that lose the
    connection because of it report later than the rank that caused it."""
    exit_code = 1
    try:
        _set_own_process_group(0)
        _die_with_parent(parent_pid)
        try:
            os.environ.update(
                MASTER_ADDR=_HOST,
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
            )
            torch.set_num_threads(threads_per_worker)
            dist.init_process_group(
                "gloo",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
        except BaseException:
            _report(conn, "setup", traceback.format_exc(), time.monotonic())
        else:
            try:
                result = fn(rank, world_size, *args)
            except BaseException:
                _report(conn, "error", traceback.format_exc(), time.monotonic())
            else:
                dist.destroy_process_group()
                _report(conn, "ok", result, time.monotonic())
        exit_code = 0
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream must not stop the exit
                stream.flush()
        os._exit(exit_code)


def _report(
    conn: multiprocessing.connection.Connection, status: str, payload: Any, when: float
) -> None:
    try:
        message = pickle.dumps((status, payload, when))
    except Exception:
        text = "the return value could not be pickled:\n" + traceback.format_exc()
        message = pickle.dumps(("error", text, when))
    conn.send_bytes(message)
    conn.close()


def _die_with_parent(parent_pid: int) -> None:
    """On Linux, have the kernel SIGKILL this worker when the parent dies (say pytest is
    killed mid-call); the worker runs in its own process group, out of reach of a
    kill aimed at the parent's group."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _set_own_process_group(pid: int) -> None:
    """Make ``pid`` (0: this process) lead its own process group; done on both sides of
    the fork so a kill right after start still reaches the whole group."""
    with contextlib.suppress(OSError):  # already exited, or done by the other side
        os.setpgid(pid, 0)


def _kill_tree(proc: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL a worker's process group (the worker and anything it started)."""
    pid = proc.pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):  # no such group
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
