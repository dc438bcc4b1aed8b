"""A temporary folder too long for the ranks' sockets is refused before any rank starts.

The ranks' sockets (the checkpoint writer's result-queue manager, torch's tensor sharing)
live under the run's folder in TMPDIR; with TMPDIR over 36 characters a save failed in a
worker with "AF_UNIX path too long" and the run with a bare ``EOFError``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import OUR_LOOP

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_gpt_cpu.yaml"


@pytest.mark.megatron
@pytest.mark.slow
def test_a_long_tmpdir_is_one_sentence_before_any_rank(tmp_path: Path) -> None:
    temp = tmp_path / ("t" * max(1, 48 - len(str(tmp_path))))
    temp.mkdir()
    length = len(str(temp))
    sets = ["train_iters=2", "lr_warmup_iters=1", f"save={tmp_path / 'save'}", "save_interval=1"]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "megatron_dualpipe.cli", "train", "--config", str(TINY), *OUR_LOOP]
        + [arg for key in sets for arg in ("--set", key)],
        cwd=ROOT,
        env=dict(os.environ, TMPDIR=str(temp)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == (
        f"megatron-dualpipe: error: TMPDIR {temp} is {length} characters long, and the ranks' "
        "sockets live under it, which leaves it at most 36 (an AF_UNIX socket path is at most "
        "107 bytes): set TMPDIR to a shorter directory, such as /tmp"
    )
    assert "iteration" not in done.stdout  # no rank ran
    assert time.monotonic() - started < 60
