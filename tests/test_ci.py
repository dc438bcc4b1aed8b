"""CI's driver (``.ci/run``) runs both legs whatever the first one gives, prints each leg's
result, and fails when either failed: one red leg must not hide the other's result. Leg 2
runs beside leg 1, started only after leg 1's editable install."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What each stand-in does when run: exit with its code, leaving a mark that it ran.
STAND_IN = '#!/usr/bin/env bash\necho "{name} ran" >> "$RAN_LOG"\nexit {code}\n'


def _ci(
    tmp_path: Path, *, install: int, py312: int, pytest_waits_for: str = ""
) -> subprocess.CompletedProcess:
    """``.ci/run`` in a copy of the repository's layout whose legs are stand-ins; leg 1's
    pytest stand-in can wait (10 s at most) for a line of the run log before it ends."""
    (tmp_path / ".ci").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    stand_ins = {
        ".ci/slurm_up.sh": ("slurm_up", 0),
        ".ci/py312.sh": ("py312", py312),
        "scripts/install.sh": ("install", install),
    }
    for path, (name, code) in stand_ins.items():
        (tmp_path / path).write_text(STAND_IN.format(name=name, code=code))
    bin_dir = tmp_path / "bin"  # ruff and python -m pytest of leg 1, as stand-ins too
    bin_dir.mkdir()
    (bin_dir / "ruff").write_text(STAND_IN.format(name="ruff", code=0))
    wait = (
        f'for _ in $(seq 100); do grep -q "{pytest_waits_for}" "$RAN_LOG" && exit 0; '
        "sleep 0.1; done\nexit 9\n"
        if pytest_waits_for
        else ""
    )
    (bin_dir / "python").write_text(
        STAND_IN.format(name="pytest", code=0).replace("exit 0", wait + "exit 0")
    )
    for tool in ("ruff", "python"):
        (bin_dir / tool).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "RAN_LOG": str(tmp_path / "ran.log"),
    }
    return subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(("install", "py312"), [(3, 0), (0, 4), (3, 4)])
def test_a_failing_leg_does_not_stop_the_other(tmp_path: Path, install: int, py312: int) -> None:
    run = _ci(tmp_path, install=install, py312=py312)
    legs = [ln for ln in run.stdout.splitlines() if ln.startswith("ci: leg Python")]
    assert len(legs) == 4, run.stdout  # each leg as it ends, then both in the summary
    first, second = legs[2:]
    assert first.startswith("ci: leg Python 3.11") and second.startswith("ci: leg Python 3.12")
    assert (f"failed (exit {install})" if install else ": passed, ") in first
    assert (f"failed (exit {py312})" if py312 else ": passed, ") in second
    assert "py312 ran" in (tmp_path / "ran.log").read_text()
    assert run.returncode == 1


def test_both_legs_passing_pass(tmp_path: Path) -> None:
    run = _ci(tmp_path, install=0, py312=0)
    assert run.returncode == 0, run.stdout + run.stderr
    ran = (tmp_path / "ran.log").read_text().split("\n")[:-1]
    assert sorted(ran) == ["install ran", "py312 ran", "pytest ran", "ruff ran", "slurm_up ran"]
    assert ran[:2] == ["slurm_up ran", "install ran"]  # leg 2 starts after leg 1's install
    assert ran.index("ruff ran") < ran.index("pytest ran")
    assert "ci: both legs in " in run.stdout


def test_leg_2_runs_beside_leg_1(tmp_path: Path) -> None:
    """Leg 2 has started before leg 1's tests end: a leg-1 pytest that waits for leg 2's
    mark would time out if the legs ran one after the other."""
    run = _ci(tmp_path, install=0, py312=0, pytest_waits_for="py312 ran")
    assert run.returncode == 0, run.stdout + run.stderr
