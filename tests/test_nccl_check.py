"""``scripts/nccl_check.py`` on CPU: ``--dry-run`` lists every check with what it checks and
needs, and why it cannot run here; without it every check says CANNOT RUN with its reason
and the exit code is 0 (a check that cannot run is not a failure). The checks themselves
need two or more GPUs under torchrun and have not run (docs/runtime.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECKS = {
    "dualpipev-pp2": "2 GPUs and megatron-core",
    "dualpipev-pp4": "4 GPUs and megatron-core",
    "dualpipe-pp4": "4 GPUs and megatron-core",
    "shared-streams": "2 GPUs and megatron-core",
    "rank-killed": "2 GPUs",
    "mirror": "2 GPUs and megatron-core",
    "mirror-distributed-optimizer": "2 GPUs and megatron-core",
    "nccl-memory": "2 GPUs and megatron-core",
}


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "nccl_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
@pytest.mark.slow
def test_dry_run_lists_every_check_and_what_it_needs() -> None:
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"CHECK {name}" for name in CHECKS]
    for line, needs in zip(lines, CHECKS.values(), strict=True):
        assert ": CANNOT RUN: no CUDA device; it checks " in line
        assert line.endswith(f"(needs {needs})")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_on_cpu_every_check_cannot_run_with_its_reason_and_exit_code_0() -> None:
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "".join(f"CHECK {name}: CANNOT RUN: no CUDA device\n" for name in CHECKS)
    only = _run("--only", "rank-killed", "--only", "nccl-memory")
    assert only.stdout.splitlines() == [
        "CHECK rank-killed: CANNOT RUN: no CUDA device",
        "CHECK nccl-memory: CANNOT RUN: no CUDA device",
    ]


def _check_on_gloo(rank: int, world: int, name: str) -> tuple[bool, str]:
    """Check ``name``'s logic on forked gloo ranks, its world made as Megatron-LM makes it
    (what NCCL then runs on GPUs)."""
    import argparse
    import importlib.util

    from megatron.core import parallel_state

    spec = importlib.util.spec_from_file_location("nccl_check", ROOT / "scripts" / "nccl_check.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up
    spec.loader.exec_module(script)
    (check,) = [c for c in script.CHECKS if c.name == name]
    try:
        return check.run(argparse.Namespace(timeout=30.0, tol=1e-5), None)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["dualpipev-pp4", "dualpipe-pp4", "mirror"])
def test_a_schedule_check_passes_on_gloo_in_megatrons_world(name: str) -> None:
    from tests.multiproc import run_workers

    results = run_workers(_check_on_gloo, 4, args=(name,), timeout_s=120)
    assert all(ok for ok, _ in results), results
    assert all("max relative error" in detail for _, detail in results)
