"""Helpers of the tests that start ``megatron-dualpipe`` as a subprocess and watch it."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["as_from_a_terminal", "wait_for"]

#: The signals a command started from a terminal has at their defaults; a test runner
#: started under nohup (or in a shell's background) passes them on ignored.
_TERMINAL_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)


def as_from_a_terminal() -> None:
    """``preexec_fn`` for a command the test signals: each of those signals at its default,
    as a command typed in a terminal has it, whatever this process inherited."""
    for signum in _TERMINAL_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


#: How long a started command may take to reach what a test waits for on a busy machine.
START_TIMEOUT_S = 240.0


def wait_for(
    what: str, check: Callable[[], Any], proc: subprocess.Popen, timeout_s: float = START_TIMEOUT_S
) -> Any:
    """``check()``'s first true value, polled every 2 ms; the test fails (and ``proc`` is
    killed) when ``proc`` exits first or nothing comes within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if proc.poll() is not None:
            pytest.fail(f"the command exited with {proc.returncode} before {what}")
        time.sleep(0.002)
    proc.kill()
    pytest.fail(f"no {what} within {timeout_s} s")
