"""A save that notices when a process it started dies.

dist_checkpointing's ``torch_dist`` save forks writer processes and waits for every one
(``FileSystemWriterAsync.write_preloaded_data_multiproc`` joins their count queue); a
writer killed mid-save (the out-of-memory killer, ``kill -9``) never reports, so the rank
waits until its peers time out, or a broken pipe surfaces later as an unrelated error
("BrokenPipeError ... free space"). While a save runs, :func:`writers_watched` answers
SIGCHLD by looking at this process's exited children without reaping them (``waitid``
with ``WNOWAIT``: multiprocessing still collects them) and raises :class:`WriterDied` from
the wait when one ended by a signal or a non-zero exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import psutil

__all__ = ["WriterDied", "writers_watched"]


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
