"""Which forked children :func:`megatron_dualpipe.lifetime.forks_die_with_forker` ties to
their forker: each child reads its own parent-death signal back from the kernel."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable

import pytest

from megatron_dualpipe.lifetime import forks_die_with_forker

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"
)

#: ``PR_GET_PDEATHSIG`` from ``<linux/prctl.h>``.
_PR_GET_PDEATHSIG = 2


def _death_signal_of_a_child(fork_from_thread: bool) -> int:
    """Fork a child (from the main thread or another one) that writes its parent-death
    signal to a pipe; return it."""
    read, write = os.pipe()
    found: list[int] = []

    def fork() -> None:
        pid = os.fork()
        if pid == 0:
            signal = ctypes.c_int(-1)
            ctypes.CDLL(None).prctl(_PR_GET_PDEATHSIG, ctypes.byref(signal))
            os.write(write, signal.value.to_bytes(4, "little", signed=True))
            os._exit(0)
        found.append(pid)

    if fork_from_thread:
        thread = threading.Thread(target=fork)
        thread.start()
        thread.join()
    else:
        fork()
    value = int.from_bytes(os.read(read, 4), "little", signed=True)
    os.waitpid(found[0], 0)
    os.close(read)
    os.close(write)
    return value


def _in_a_process_of_its_own(body: Callable[[], list[int]]) -> list[int]:
    """Run ``body`` (which returns a list of signals) in a forked process that called
    :func:`forks_die_with_forker` (the registration lasts a process's life: not pytest's)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            forks_die_with_forker()
            values = body()
            os.write(write, ",".join(map(str, values)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    text = os.read(read, 100).decode()
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return [int(v) for v in text.split(",")]


def _grandchild() -> list[int]:
    """The signal of a child forked by a child (forked by the main thread of each)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, str(_death_signal_of_a_child(False)).encode())
        os._exit(0)
    value = int(os.read(read, 10))
    os.waitpid(pid, 0)
    return [value]


def test_a_child_forked_by_the_main_thread_dies_with_its_forker() -> None:
    assert _in_a_process_of_its_own(lambda: [_death_signal_of_a_child(False)]) == [9]  # SIGKILL


def test_a_child_forked_by_another_thread_is_left_alone() -> None:
    """The signal follows the forking thread: a thread that ends would take its child."""
    assert _in_a_process_of_its_own(lambda: [_death_signal_of_a_child(True)]) == [0]


def test_a_child_s_own_forks_die_with_it() -> None:
    assert _in_a_process_of_its_own(_grandchild) == [9]


def test_a_process_that_did_not_ask_leaves_its_children_alone() -> None:
    assert _death_signal_of_a_child(False) == 0
