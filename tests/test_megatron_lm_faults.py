"""Faults under Megatron-LM's own loop (``train`` on megatron-core 0.19): what
docs/reliability.md's rows say of that loop, made to happen for real and bounded in time.

A diverging run stops at Megatron-LM's own result validation, which saves a checkpoint and
exits with its code for a rerun: the command says what that code means in one line. A rank
killed with SIGKILL is named by this project's launcher, which forks the ranks here as it
does for its own loop, and nothing of the run outlives it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_dualpipe.megatron.checkpoint.files import (
    TRACKER,
    complete_iterations,
    damage,
    iteration_dir,
)
from tests.processes import as_from_a_terminal, wait_for
from tests.test_fault_ranks import STOP_WITHIN_S, _gone_soon, _ranks

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc, pytest.mark.slow, pytest.mark.route]

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_gpt_cpu.yaml"


def _command(*sets: str) -> list[str]:
    """``train`` of the tiny config with ``sets``."""
    items = [arg for item in sets for arg in ("--set", item)]
    return [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(TINY), *items]


def test_a_diverging_run_stops_at_megatron_lm_s_check_with_its_exit_code_said(
    tmp_path: Path,
) -> None:
    save = tmp_path / "ckpt"
    sets = ("lr=1e6", "min_lr=0", "train_iters=8", "eval_interval=8", f"save={save}")
    done = subprocess.run(
        _command(*sets, "save_interval=2"), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "found NaN in local grad norm" in done.stdout + done.stderr
    said = (
        "Megatron-LM's result validation (check_for_nan_in_loss_and_grad, rerun_mode "
        "validate_results) stopped the run with exit code 16 (the lines above say why: a NaN "
        "or another unexpected value that a rerun in place reproduced, or a resumed rerun on "
        "the same device), for it to be resumed from its checkpoint on other hardware, which "
        "tells a device's fault from the model's; on this machine such a resume stops the "
        "same way: if the run diverges, lower lr or clip_grad, and set rerun_mode: disabled to "
        "resume from that checkpoint here (a NaN then stops the run on the rank that saw it)"
    )
    # Said once where every rank reported it; a rank killed late, 2 s after the first one
    # failed (the launcher's grace on a loaded machine), leaves the first rank's alone.
    last = done.stderr.splitlines()[-1]
    assert last == f"megatron-dualpipe: error: {said}" or re.fullmatch(
        rf"megatron-dualpipe: error: rank [01] of 2 failed: {re.escape(said)}", last
    ), last
    assert " iteration        2/       8 |" in done.stdout
    assert " iteration        4/" not in done.stdout
    assert int((save / TRACKER).read_text()) == 2  # the steps before the NaN, whole
    assert damage(iteration_dir(save, 2)) is None


def test_kill_9_of_a_rank_is_named_and_nothing_outlives_the_command(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    sets = ("train_iters=300", "eval_interval=300", "eval_iters=0", f"save={save}")
    proc = subprocess.Popen(
        _command(*sets, "save_interval=1"),
        cwd=ROOT,
        stdout=out.open("w"),
        stderr=err.open("w"),
        preexec_fn=as_from_a_terminal,
    )
    try:
        # Complete iteration folders, not the tracker: Megatron-LM rewrites it in place.
        saved = wait_for("a checkpoint", lambda: complete_iterations(save) or None, proc)
        ranks = _ranks(proc)
        assert len(ranks) == 2, ranks
        everyone = psutil.Process(proc.pid).children(recursive=True)
        ranks[1].kill()
        killed = time.monotonic()
        assert _gone_soon([p.pid for p in everyone], within_s=STOP_WITHIN_S) == []
        assert proc.wait(timeout=60) == 2
    finally:
        proc.kill()
    assert time.monotonic() - killed < STOP_WITHIN_S + 60  # + the interpreter's teardown
    assert err.read_text().splitlines()[-1] == (
        "megatron-dualpipe: error: rank 1 of 2 failed: it was killed by SIGKILL, signal 9 "
        "before reporting a result (killed from outside, or by the out-of-memory killer)"
    )
    assert set(saved) <= set(complete_iterations(save))  # what was saved stays whole
