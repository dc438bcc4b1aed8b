"""One run per save directory: a second holder is refused in one sentence naming the
first one's pid; the lock goes with its holder however it ends, so what a dead run leaves
behind locks nothing. ``train`` holding it for a run: tests/test_megatron_lm_launch.py.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.checkpoint.lock import (
    LOCK_NAME,
    SaveDirectoryInUse,
    save_lock,
)

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
HOST = socket.gethostname()


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    save = tmp_path / "shared"
    with save_lock(save), pytest.raises(SaveDirectoryInUse) as info, save_lock(save):
        pass
    assert re.fullmatch(
        rf"save: {re.escape(str(save))} is in use by another run \(pid {os.getpid()} on "
        rf"{re.escape(HOST)}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\): wait for it to "
        r"finish, or set save to another directory",
        str(info.value),
    ), info.value
    with save_lock(save):  # released at the end of the block
        pass


def test_a_lock_file_left_by_a_dead_run_is_taken_over(tmp_path: Path) -> None:
    save = tmp_path / "shared"
    save.mkdir()
    (save / LOCK_NAME).write_text(f"999999999 {HOST} 2026-01-01 00:00:00\n")
    with save_lock(save):
        assert (save / LOCK_NAME).read_text().startswith(f"{os.getpid()} {HOST} ")


@pytest.mark.slow
def test_a_holder_killed_with_sigkill_releases_the_lock(tmp_path: Path) -> None:
    save = tmp_path / "shared"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(save)], stdout=subprocess.PIPE, cwd=ROOT, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(SaveDirectoryInUse, match=rf"\(pid {holder.pid} on "), save_lock(save):
            pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        with save_lock(save):
            pass
    finally:
        holder.kill()
        holder.wait()


_HOLD = """
import sys, time
from megatron_dualpipe.megatron.checkpoint.lock import save_lock
with save_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""
