"""One run per save directory: a second run is refused in one sentence naming the first
one's pid; the lock goes with the run however it ends, so what a dead run leaves behind
locks nothing.

Before, two ``train --set save=shared`` runs at once both exited 0 and both reported
"checkpoints in shared", which held only the second run's.
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
from tests.processes import OUR_LOOP, wait_for

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_gpt_cpu.yaml"
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


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_second_train_on_the_same_save_is_refused(tmp_path: Path) -> None:
    save = tmp_path / "shared"
    sets = ["output_dir=null", "eval_interval=null", "log_interval=1", f"save={save}"]

    def train(*more: str, out: str) -> subprocess.Popen:
        args = [arg for item in (*sets, *more) for arg in ("--set", item)]
        return subprocess.Popen(
            [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(TINY), *OUR_LOOP]
            + args,
            cwd=ROOT,
            stdout=(tmp_path / f"{out}.out").open("w"),
            stderr=(tmp_path / f"{out}.err").open("w"),
        )

    first = train("train_iters=300", "save_interval=100", out="first")
    try:
        wait_for("the first iteration", lambda: "iteration        1/" in _read(tmp_path, "first"),
                 first)  # fmt: skip
        second = train("train_iters=3", out="second")
        assert second.wait(timeout=120) == 2
        assert (
            _read(tmp_path, "second", "err")
            .splitlines()[-1]
            .startswith(
                f"megatron-dualpipe: error: save: {save} is in use by another run (pid {first.pid} "
                f"on {HOST}, started "
            )
        )
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait()
    # The killed run's lock went with it (the third resumes it: the first may have saved).
    third = train("train_iters=3", f"load={save}", out="third")
    assert third.wait(timeout=240) == 0, _read(tmp_path, "third", "err")


def _read(tmp_path: Path, name: str, stream: str = "out") -> str:
    return (tmp_path / f"{name}.{stream}").read_text()
