"""Processes that die with the process that started them.

:func:`die_with_parent` is called first thing in a child this package starts (a forked
rank, the checkpoint writer's queue manager): on Linux it asks the kernel to SIGKILL the
calling process when its parent goes, for whatever reason (``kill -9`` included), then
checks that the parent is still the one it was started by (a parent that died before the
request took effect would never send the signal). Elsewhere only that check runs.

Standard library only, so a spawned interpreter that runs it imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

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
