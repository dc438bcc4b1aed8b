"""Run a function on N forked CPU+gloo ranks and collect what each returns.

:func:`run_ranks` forks the ranks (the caller's imports are paid once); rank 0 hosts the
rendezvous store on the loopback address. A call never hangs and leaves nothing behind: a
rank that fails or dies is named (:class:`LaunchFailure`), and after it, or at
``timeout_s``, every rank still running is killed with its process group; a guard process
kills that group if the parent dies, however it ends. The parent's OpenMP pool is released
before the fork (:mod:`.openmp`). How, and the faults tested: docs/runtime.md ("Starting
ranks"), docs/reliability.md ("Processes that die").
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DualPipeError
from ..lifetime import die_with_parent, forks_die_with_forker
from .openmp import release_thread_pool

__all__ = [
    "GUARD_NAME",
    "LaunchFailure",
    "TempDirTooLong",
    "pick_port",
    "process_tmpdir",
    "run_ranks",
]

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_FAILURE_GRACE_S = 2.0
#: The same after a rank died without a word: the cause is known, the rest is its echo.
_DEATH_GRACE_S = 0.5
#: How often ranks are polled where the kernel has no pidfd.
_POLL_S = 0.2
#: How long to wait for a rank whose result pipe closed to exit.
_EXIT_WAIT_S = 1.0
_LAUNCH_ATTEMPTS = 3
#: The process name of a launch's guard (:class:`_RunGroup`), as ``ps`` shows it.
GUARD_NAME = "dualpipe-guard"
#: The run's temporary directory: this, the parent's pid, a dash, a random tail.
_TMPDIR_PREFIX = "megatron-dualpipe-run-"
#: The lock file of a :func:`process_tmpdir` directory.
_HELD = ".held"
#: The longest AF_UNIX socket path: ``sun_path`` less its closing NUL (108 bytes on Linux).
_SOCKET_PATH_MAX = (108 if sys.platform.startswith("linux") else 104) - 1
#: What goes under the temporary folder before a rank's socket name ends: the run's folder
#: (the prefix, a pid of up to 7 digits, a dash, mkdtemp's 8 random characters), then
#: multiprocessing's ``pymp-`` folder and a listener's name in it (``util.get_temp_dir``,
#: ``connection.arbitrary_address``: each 8 random characters after its prefix), the
#: sockets of the checkpoint writer's result-queue manager and of torch's tensor sharing.
_SOCKET_TAIL = len(f"/{_TMPDIR_PREFIX}1234567-abcdefgh/pymp-abcdefgh/listener-abcdefgh")
_ports_handed_out: set[int] = set()


class TempDirTooLong(DualPipeError, ValueError):
    """The temporary folder leaves no room for the ranks' socket paths (see
    :func:`check_tmpdir`)."""


def check_tmpdir() -> None:
    """Raise :class:`TempDirTooLong` where a socket the ranks open under the temporary
    folder (TMPDIR) would be longer than an AF_UNIX path may be: multiprocessing's bind
    would fail in a worker ("AF_UNIX path too long"), and the rank with a bare EOFError."""
    root = tempfile.gettempdir()
    limit = _SOCKET_PATH_MAX - _SOCKET_TAIL
    length = len(os.fsencode(root))
    if length > limit:
        raise TempDirTooLong(
            f"TMPDIR {root} is {length} characters long, and the ranks' sockets live under "
            f"it, which leaves it at most {limit} (an AF_UNIX socket path is at most "
            f"{_SOCKET_PATH_MAX} bytes): set TMPDIR to a shorter directory, such as /tmp"
        )


class LaunchFailure(DualPipeError, RuntimeError):
    """Some ranks failed or overran the deadline (and were killed).

    ``errors`` are (rank, kind, text), kind "setup" (before ``fn`` ran), "died" (exited
    without reporting) or "error": ranks that died first (their peers' errors follow from
    the death), then in the order the ranks failed, so the root cause comes first;
    ``unfinished`` are the ranks killed at the deadline or after the first failure, and
    ``stopped`` those of them that were stopped (SIGSTOP, a debugger) when killed;
    ``guard``, where the run's guard process died while the ranks ran, how it ended (then
    every rank still running was killed at once, and that is the failure)."""

    def __init__(
        self,
        world_size: int,
        errors: list[tuple[int, str, str]],
        unfinished: list[int],
        timeout_s: float | None,
        stopped: Sequence[int] = (),
        guard: str | None = None,
    ) -> None:
        self.world_size, self.errors, self.unfinished = world_size, errors, unfinished
        self.stopped, self.guard = list(stopped), guard
        if guard is not None:
            message = guard
        elif errors:
            rank, _, text = errors[0]
            parts = [f"--- rank {r} ({kind}) ---\n{t}" for r, kind, t in errors]
            if unfinished:
                parts.append(f"(ranks {unfinished} were killed after the first failure)")
            message = (
                f"{len(errors)} of {world_size} ranks failed, first rank {rank}: "
                f"{text.splitlines()[0] if text else '?'}\n" + "\n".join(parts)
            )
        else:
            message = (
                f"ranks {unfinished} of {world_size} did not finish within {timeout_s:.1f} s "
                "and were killed"
            )
        super().__init__(message)

    @property
    def first(self) -> str:
        """One line for the root cause: ``rank R of N failed: <its text>``, or the ranks that
        overran the deadline, or the guard's death."""
        if self.guard is not None:
            return self.guard
        if not self.errors:
            return str(self) + self._stopped_note()
        rank, _, text = self.errors[0]
        return f"rank {rank} of {self.world_size} failed: {text}{self._stopped_note()}"

    @property
    def cause(self) -> str:
        """The failure in one line: a text every rank failed with (a verdict they reached
        together, the same error seen on each) said once, without a rank; else
        :attr:`first`."""
        texts = {text for _, _, text in self.errors}
        if len(texts) == 1 and len(self.errors) == self.world_size:
            return texts.pop()
        return self.first

    def _stopped_note(self) -> str:
        if not self.stopped:
            return ""
        ranks = ", ".join(map(str, self.stopped))
        were = "were" if len(self.stopped) > 1 else "was"
        return (
            f" (rank{'s' if len(self.stopped) > 1 else ''} {ranks} {were} stopped, by SIGSTOP or "
            "a debugger, and never answered)"
        )


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float | None = 60.0,
    pg_timeout_s: float = 10.0,
    threads_per_rank: int = 1,
    plain_errors: tuple[type[BaseException], ...] = (),
    failure_as: Callable[[LaunchFailure], BaseException] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks, each with the
    default gloo process group (``pg_timeout_s``) and the torchrun environment variables
    set; return their picklable results in rank order, or raise :class:`LaunchFailure`
    (or, given ``failure_as``, the caller's own error made from it).

    A temporary folder too long for the ranks' socket paths raises :class:`TempDirTooLong`
    before any rank starts. ``timeout_s`` None waits as long as the ranks run. An exception
    of a ``plain_errors`` type is reported by its message alone (it explains itself); others
    as ``Type: message`` followed by the traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_tmpdir()
    deadline = float("inf") if timeout_s is None else time.monotonic() + timeout_s
    for attempt in range(1, _LAUNCH_ATTEMPTS + 1):
        results, errors, unfinished, stopped, guard = _launch(
            fn, world_size, tuple(args), deadline, pg_timeout_s, threads_per_rank, plain_errors
        )
        setup_failed = errors and all(kind == "setup" for _, kind, _ in errors)
        if not (setup_failed and attempt < _LAUNCH_ATTEMPTS and time.monotonic() < deadline):
            break
        logger.warning("run_ranks: rendezvous failed (attempt %d), retrying", attempt)
    if errors or unfinished:
        failure = LaunchFailure(world_size, errors, unfinished, timeout_s, stopped, guard)
        raise failure if failure_as is None else failure_as(failure)
    return [results[rank] for rank in range(world_size)]


def _launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    deadline: float,
    pg_timeout_s: float,
    threads: int,
    plain_errors: tuple[type[BaseException], ...],
) -> tuple[dict[int, Any], list[tuple[int, str, str]], list[int], list[int], str | None]:
    """Fork the ranks once, collect their reports, and leave none running; also the
    unfinished ranks found stopped before they were killed, and the guard's death."""
    ctx = multiprocessing.get_context("fork")
    release_thread_pool()  # a pool inherited from here would hang the ranks' parallel ops
    port = pick_port()
    procs: list[multiprocessing.process.BaseProcess] = []
    watches: list[_Watch] = []
    group = _RunGroup()
    try:
        with _objects_frozen():
            for rank in range(world_size):
                recv_end, send_end = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(
                        send_end,
                        os.getpid(),
                        group,
                        fn,
                        rank,
                        world_size,
                        args,
                        port,
                        pg_timeout_s,
                        threads,
                        plain_errors,
                    ),
                    name=f"rank{rank}",
                )
                proc.start()
                send_end.close()
                group.join(proc.pid)
                procs.append(proc)
                watches.append(_Watch(rank, proc, recv_end))
        results, errors, unfinished = _collect(watches, deadline, group)
        guard = group.death()
        stopped = [rank for rank in unfinished if _is_stopped(procs[rank].pid)]
        return results, errors, unfinished, stopped, guard
    finally:
        with _stop_signals_held():  # a second Ctrl-C or SIGTERM must not cut this short
            group.kill()
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):  # not in the group after all
                    os.kill(proc.pid, signal.SIGKILL)
            for proc in procs:
                proc.join()
                proc.close()
            for watch in watches:
                watch.close()
            group.close()


@contextlib.contextmanager
def _objects_frozen() -> Iterator[None]:
    """Within the block, this process's objects are out of the garbage collector's reach
    (``gc.freeze``), so processes forked meanwhile never collect what they inherit: their
    collections neither walk it nor copy its pages (CPython's advice for forking without
    exec). Back in reach on leaving."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


#: What stops a run from outside: Ctrl-C, ``kill``, a closed terminal.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Within the block, a stop signal is held and raised again on leaving it, so the
    block (the ranks killed, the run's folder removed) runs to its end; outside the main
    thread, where no handler can be set, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    for signum, handler in previous.items():
        if handler not in (signal.SIG_IGN, None):
            signal.signal(signum, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


class _RunGroup:
    """The process group of one launch: a guard process forked here leads it, every rank
    joins it, and what the ranks start inherits it. :meth:`kill` ends all of it; if this
    process dies first, the guard does (docs/reliability.md)."""

    def __init__(self) -> None:
        parent = os.getpid()
        _remove_orphaned_tmpdirs()
        self.tmpdir = tempfile.mkdtemp(prefix=f"{_TMPDIR_PREFIX}{parent}-")
        pid = os.fork()
        if pid == 0:
            _guard_main(parent, self.tmpdir)  # never returns
        self.pgid = pid
        self.join(pid)
        self.pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # not Linux >= 5.3
            self.pidfd = os.pidfd_open(pid)

    def death(self) -> str | None:
        """The sentence for a guard that is gone while the ranks run, or None while it runs
        (nothing is reaped)."""
        try:
            info = os.waitid(os.P_PID, self.pgid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = None
        if info is None:
            return None
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        how = ("was " if killed else "") + _ending(-info.si_status if killed else info.si_status)
        return (
            f"the run's guard process ({GUARD_NAME}, pid {self.pgid}) {how} while the ranks "
            "ran; without it nothing would stop the ranks if this process died, so they were "
            "killed: find what ended it (a kill aimed at it, the out-of-memory killer) and "
            "start the run again"
        )

    def join(self, pid: int) -> None:
        """Move ``pid`` (0: this process) into the group; done on both sides of a fork so a
        kill right after the start still reaches it."""
        with contextlib.suppress(OSError):  # already exited, or done by the other side
            os.setpgid(pid, self.pgid)

    def kill(self) -> None:
        """SIGKILL every process of the group: the ranks, their children, the guard."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)

    def close(self) -> None:
        """Reap the guard and remove the run's temporary directory (after :meth:`kill`)."""
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pgid, 0)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        shutil.rmtree(self.tmpdir, ignore_errors=True)


@contextlib.contextmanager
def process_tmpdir() -> Iterator[Path]:
    """A temporary directory of this process for the block, removed after it. It is named
    as a run's is (this pid in the name) and held (a lock on a file in it) as long as this
    process or a child it forks lives, so a launch removes it only where all of them are
    gone (a ``kill -9``): :func:`_remove_orphaned_tmpdirs`, which this runs first too."""
    _remove_orphaned_tmpdirs()
    path = Path(tempfile.mkdtemp(prefix=f"{_TMPDIR_PREFIX}{os.getpid()}-"))
    held = os.open(path / _HELD, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(held)
        shutil.rmtree(path, ignore_errors=True)


def _held(path: Path) -> bool:
    """Whether a live process holds ``path``'s lock file (:func:`process_tmpdir`)."""
    try:
        held = os.open(path / _HELD, os.O_RDWR)
    except OSError:  # no lock file: a run's directory, judged by its pid alone
        return False
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(held)
    return False


def _remove_orphaned_tmpdirs() -> None:
    """Remove this user's run directories (in the temporary folder) whose parent process,
    named by the pid in the directory's name, no longer exists and whose lock file (where
    there is one) nobody holds: left by a run killed all at once (see the module
    docstring)."""
    root = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for path in root.glob(f"{_TMPDIR_PREFIX}*-*"):
            pid = path.name[len(_TMPDIR_PREFIX) :].split("-", 1)[0]
            with contextlib.suppress(OSError):
                mine = pid.isdigit() and path.stat().st_uid == os.getuid()
                if mine and not process_exists(int(pid)) and not _held(path):
                    shutil.rmtree(path, ignore_errors=True)


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (of any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _guard_main(parent: int, tmpdir: str) -> None:
    """The guard: lead the run's process group, wait for ``parent`` to exit, then remove
    ``tmpdir`` and SIGKILL the group (this process too). Signals meant for the parent's
    terminal are ignored; only the parent's exit ends the wait."""
    try:
        os.setpgid(0, 0)
        _name_process(GUARD_NAME)
        for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        _wait_for_exit(parent)
        shutil.rmtree(tmpdir, ignore_errors=True)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGKILL)
        os._exit(0)


def _wait_for_exit(pid: int) -> None:
    """Return once ``pid`` (this process's parent) has exited: through a pidfd, or by
    polling the parent's pid where the kernel has no pidfd."""
    pidfd = None
    with contextlib.suppress(AttributeError, OSError):  # gone already, or not Linux >= 5.3
        pidfd = os.pidfd_open(pid)
    if pidfd is not None and os.getppid() == pid:
        select.select([pidfd], [], [])
        return
    while os.getppid() == pid:
        time.sleep(_POLL_S)


def pick_port() -> int:
    """A port free right now that this process has not handed out before."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((_HOST, 0))
            port = sock.getsockname()[1]
        if port not in _ports_handed_out:
            _ports_handed_out.add(port)
            return port


class _Watch:
    """One rank as the parent sees it: its result pipe and its process (a pidfd that
    becomes readable when the process exits, or None where the kernel has none)."""

    def __init__(
        self,
        rank: int,
        proc: multiprocessing.process.BaseProcess,
        conn: multiprocessing.connection.Connection,
    ) -> None:
        self.rank, self.proc, self.conn = rank, proc, conn
        self.pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # not Linux >= 5.3
            self.pidfd = os.pidfd_open(proc.pid)

    def report(self) -> tuple[str, Any, float]:
        """The rank's (status, payload, time): its report, or ("died", why, now) when it
        exited without one."""
        try:
            if self.conn.poll():
                return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            pass
        self.proc.join(timeout=_EXIT_WAIT_S)  # its pipe closed: the exit is moments away
        return "died", _death_text(self.proc.exitcode), time.monotonic()

    def close(self) -> None:
        self.conn.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _is_stopped(pid: int | None) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, a debugger): state T or t in ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")


def _death_text(exitcode: int | None) -> str:
    """Why a rank that never reported is gone, from its exit code."""
    if exitcode is None:
        return "it closed its result pipe without reporting and did not exit"
    if exitcode < 0:
        return (
            f"it was {_ending(exitcode)} before reporting a result (killed from outside, "
            "or by the out-of-memory killer)"
        )
    return f"it {_ending(exitcode)} without reporting a result"


def _ending(exitcode: int) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it):
    "killed by SIGKILL, signal 9", "exited with code 1"."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        return f"killed by {signal.Signals(-exitcode).name}, signal {-exitcode}"
    except ValueError:
        return f"killed by signal {-exitcode}"


def _collect(
    watches: list[_Watch], deadline: float, group: _RunGroup
) -> tuple[dict[int, Any], list[tuple[int, str, str]], list[int]]:
    """Read one report per rank until all reported, the deadline, a failure (plus the
    grace) or the guard's death (at once); errors with the ranks that died first, then in
    the order the ranks failed (each rank's own clock reading)."""
    results: dict[int, Any] = {}
    failed: list[tuple[bool, float, int, str, str]] = []
    pending: dict[Any, _Watch] = {}
    for watch in watches:
        pending[watch.conn] = watch
        if watch.pidfd is not None:
            pending[watch.pidfd] = watch
    polled = [w for w in watches if w.pidfd is None]
    guard = [] if group.pidfd is None else [group.pidfd]
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        timeout = None if remaining == float("inf") else remaining
        if polled or not guard:
            timeout = _POLL_S if timeout is None else min(timeout, _POLL_S)
        ready = multiprocessing.connection.wait(list(pending) + guard, timeout=timeout)
        if (guard and guard[0] in ready) or (not guard and group.death() is not None):
            break
        ready_watches = {pending[key] for key in ready}
        ready_watches.update(w for w in polled if w.conn in pending and not w.proc.is_alive())
        for watch in sorted(ready_watches, key=lambda w: w.rank):
            pending.pop(watch.conn, None)
            pending.pop(watch.pidfd, None)
            status, payload, when = watch.report()
            if status == "ok":
                results[watch.rank] = payload
            else:
                failed.append((status != "died", when, watch.rank, status, payload))
        if failed:
            died = any(not reported for reported, *_ in failed)
            grace = _DEATH_GRACE_S if died else _FAILURE_GRACE_S
            deadline = min(deadline, time.monotonic() + grace)
    errors = [(rank, kind, text) for _, _, rank, kind, text in sorted(failed)]
    unfinished = sorted({watch.rank for watch in pending.values()})
    return results, errors, unfinished


def _rank_main(
    conn: multiprocessing.connection.Connection,
    parent_pid: int,
    group: _RunGroup,
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    port: int,
    pg_timeout_s: float,
    threads: int,
    plain_errors: tuple[type[BaseException], ...],
) -> None:
    """One forked rank: report ("ok", result, t) or (kind, text, t) and leave by os._exit,
    so no inherited machinery (pytest, atexit) runs twice. A failure is reported before
    the process group goes down, so the peers it disconnects report later."""
    exit_code = 1
    try:
        group.join(0)
        die_with_parent(parent_pid)
        forks_die_with_forker()  # a save's writers die with the rank, whoever kills it
        # What multiprocessing leaves in the temporary directory goes with the run's.
        tempfile.tempdir = group.tmpdir
        try:
            os.environ.update(
                TMPDIR=group.tmpdir,
                MASTER_ADDR=_HOST,
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
            )
            torch.set_num_threads(threads)
            timeout = timedelta(seconds=pg_timeout_s)
            listener, store = _rendezvous(rank, world_size, port, timeout)  # kept open
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        except BaseException:
            _report(conn, "setup", traceback.format_exc())
        else:
            try:
                result = fn(rank, world_size, *args)
            except plain_errors as err:
                _report(conn, "error", str(err))
            except BaseException as err:
                _report(conn, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
            else:
                dist.destroy_process_group()
                _report(conn, "ok", result)
        exit_code = 0
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream must not stop the exit
                stream.flush()
        os._exit(exit_code)


def _rendezvous(
    rank: int, world_size: int, port: int, timeout: timedelta
) -> tuple[socket.socket | None, dist.TCPStore]:
    """The ranks' store, hosted by rank 0 on the loopback address only (torch's own binds
    every interface): on a socket bound here and handed to it. Returns the socket (keep it
    open while the store lives) and the store."""
    if rank != 0:
        return None, dist.TCPStore(_HOST, port, world_size, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((_HOST, port))
    listener.listen(max(128, world_size))
    store = dist.TCPStore(
        _HOST, port, world_size, True, timeout=timeout, master_listen_fd=listener.fileno()
    )
    return listener, store


def _report(conn: multiprocessing.connection.Connection, status: str, payload: Any) -> None:
    when = time.monotonic()
    try:
        message = pickle.dumps((status, payload, when))
    except Exception:
        text = "the result could not be pickled:\n" + traceback.format_exc()
        message = pickle.dumps(("error", text, when))
    conn.send_bytes(message)
    conn.close()


def _name_process(name: str) -> None:
    """Set this process's name as ``ps -o comm`` and psutil's ``name()`` show it (Linux)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            pr_set_name = 15
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15])
