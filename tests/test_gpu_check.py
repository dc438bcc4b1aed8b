"""``scripts/gpu_check.py --dry-run``: every GPU check is listed with what it checks and,
on a machine without CUDA, why it cannot run; nothing runs and the exit code is 0. The
checks themselves need a GPU (docs/BENCHMARKS.md says whether they have run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECKS = (
    "te-deferral-bf16",
    "te-deferral-fp8",
    "overlap-contexts-fp8",
    "layer-costs-dense",
    "layer-costs-moe",
    "graphs-te-order",
    "graphs-te-buffers",
    "graphs-full-step",
)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="says why the checks cannot run on CPU")
@pytest.mark.slow
def test_dry_run_lists_each_check_and_why_it_cannot_run_here() -> None:
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"CHECK {name}" for name in CHECKS]
    for line in lines:
        assert ": CANNOT RUN: no CUDA device; it checks " in line


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_without_a_gpu_a_full_run_says_cannot_run_and_does_not_fail() -> None:
    proc = _run("--only", "layer-costs-moe")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "CHECK layer-costs-moe: CANNOT RUN: no CUDA device\n"
