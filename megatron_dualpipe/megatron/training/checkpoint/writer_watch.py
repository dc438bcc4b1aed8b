"""A save that notices when a process it started dies, and whose processes die with the rank.

dist_checkpointing's ``torch_dist`` save forks writer processes and waits for every one
(``FileSystemWriterAsync.write_preloaded_data_multiproc`` joins their count queue); a
writer killed mid-save (the out-of-memory killer, ``kill -9``) never reports, so the rank
waits until its peers time out, or a broken pipe surfaces later as an unrelated error
("BrokenPipeError ... free space"). While a save runs, :func:`writers_watched` answers
SIGCHLD by looking at this process's exited children without reaping them (``waitid``
with ``WNOWAIT``: multiprocessing still collects them) and raises :class:`WriterDied` from
the wait when one ended by a signal or a non-zero exit.

The other way round, :func:`writer_queue_dies_with_rank` (called before each save) gives
dist_checkpointing the results queue it would make itself on the first save
(``filesystem_async``'s ``_get_write_results_queue`` in 0.16.1, ``get_write_results_queue``
from 0.19: one manager process per rank, kept for every later save, in its cache
``_results_queue``, so named in both; read in 0.16.1 and 0.19.2): the same kind of queue,
from a manager started here whose initializer makes it die with the rank
(:func:`~megatron_dualpipe.lifetime.die_with_parent`). Without it a ``kill -9`` of the
whole run leaves each rank's manager, and the resource tracker that waits on the manager's
end of its pipe, running under PID 1. dist_checkpointing takes no queue from its caller;
filling the cache it reads first is the only way in.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.managers
import os
import signal
import threading
from collections.abc import Iterator

import psutil
from megatron.core.dist_checkpointing.strategies import filesystem_async

from ....lifetime import die_with_parent

__all__ = ["WriterDied", "writer_queue_dies_with_rank", "writers_watched"]


class WriterDied(Exception):
    """A process the rank started for the save died; the message says how."""


@contextlib.contextmanager
def writers_watched() -> Iterator[None]:
    """Raise :class:`WriterDied` in the block when a child of this process fails (main
    thread only: signal handlers live there; elsewhere the block runs unwatched)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGCHLD, _on_child)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, previous)


def _on_child(signum: int, frame: object) -> None:
    death = failed_child()
    if death is not None:
        raise WriterDied(death)


def failed_child() -> str | None:
    """How the first child of this process that failed ended ("killed by SIGKILL, signal
    9", "exited with code 1"), or None; children that are running or exited cleanly, and
    nothing is reaped."""
    for child in psutil.Process().children():
        try:
            info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        if info is None:
            continue
        if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            try:
                name = signal.Signals(info.si_status).name
            except ValueError:
                name = "a signal"
            return f"killed by {name}, signal {info.si_status}"
        if info.si_code == os.CLD_EXITED and info.si_status != 0:
            return f"exited with code {info.si_status}"
    return None


def writer_queue_dies_with_rank() -> None:
    """Give dist_checkpointing's writer, where it has none yet, a results queue whose
    manager process dies with this one (see the module docstring); once per process."""
    if filesystem_async._results_queue is not None:
        return
    manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
