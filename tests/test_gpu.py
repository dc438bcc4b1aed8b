"""The GPU kind of test: ``scripts/gpu_check.py`` on one GPU and ``scripts/nccl_check.py``
under torchrun on two, run for real where the machine has them, every check passing (a
check that cannot run there says why and is not a failure); skipped where it has not
(CI's machines have no GPU). Marked ``gpu``: ``pytest -m gpu`` on a GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def _checks(command: list[str]) -> list[str]:
    """The ``CHECK`` lines of ``command``, run from the repository; it must exit 0."""
    done = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
        )},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("CHECK ")]
    assert lines, done.stdout[-2000:]
    return lines


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_gpu_check_passes_or_says_why_it_cannot_run() -> None:
    lines = _checks([sys.executable, "scripts/gpu_check.py"])
    assert [line for line in lines if ": FAIL: " in line] == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_every_nccl_check_of_two_ranks_passes() -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    lines = _checks([*torchrun, "scripts/nccl_check.py"])
    assert [line for line in lines if ": FAIL: " in line] == []
