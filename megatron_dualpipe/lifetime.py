"""Processes that die with the process that started them.

:func:`die_with_parent`, called first thing in a child this package starts, has the kernel
SIGKILL it when its parent goes (on Linux), and exits at once if the parent already has.
:func:`forks_die_with_forker` makes every child the calling process's main thread forks do
the same. Standard library only. Why and how: docs/reliability.md, "Processes that die".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

__all__ = ["die_with_parent", "forks_die_with_forker"]

#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when ``parent_pid``, its parent (the thread of
    it that started this process), exits; exit at once (code 1) if it already has."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no libc prctl: still checked
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def forks_die_with_forker() -> None:
    """From now on, every child that this process's main thread forks (and, in turn, every
    child such a child's main thread forks) dies with the process that forked it; call it
    once per process."""
    forker = threading.local()  # per thread, so another thread's fork cannot change it

    def before() -> None:
        main = threading.current_thread() is threading.main_thread()
        forker.pid = os.getpid() if main else None

    def in_child() -> None:  # the forking thread's locals survive into the child
        pid = getattr(forker, "pid", None)
        if pid is not None:
            die_with_parent(pid)

    os.register_at_fork(before=before, after_in_child=in_child)
