"""The README's save / stop / resume walkthrough runs as written.

The four ``megatron-dualpipe train`` commands of the README's "Save, stop, resume, change
the schedule" block run one after the other through the CLI (``python -m
megatron_dualpipe``, the README's relative paths in a scratch directory holding a copy of
``configs/``): stop at iteration 5 with a checkpoint, resume under 1f1b to iteration 10,
resume the final checkpoint (one line, nothing trained), train further to 15. Each
command's stdout must hold its lines whole and in order: the loaded-checkpoint line
before the first iteration, "training done" last.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAMP = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\]"


def _walkthrough() -> list[list[str]]:
    """The README block's commands, each as argv after ``megatron-dualpipe``."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("### Save, stop, resume, change the schedule", 1)[1]
    block = block.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()[:1] != "#"]
    assert all(argv[0] == "megatron-dualpipe" for argv in commands), commands
    return [argv[1:] for argv in commands]


def _saved(iteration: int) -> str:
    """Megatron-LM's checkpoint-saved line of ``iteration`` into ckpt, as a pattern."""
    return (
        rf"^  {STAMP} successfully saved checkpoint from iteration {iteration:7d} to ckpt "
        r"\[ t 1/1, p 1/2 \]$"
    )


def _iterations(lines: list[str]) -> list[int]:
    found = (re.match(rf"^ {STAMP} iteration +(\d+)/ +(\d+) \|", line) for line in lines)
    return [int(m[1]) for m in found if m]


@pytest.mark.slow
def test_the_readme_walkthrough_runs_as_written(tmp_path: Path) -> None:
    commands = _walkthrough()
    assert len(commands) == 4
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    outputs = []
    for argv in commands:
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_dualpipe", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.splitlines())
    stop, resume, again, further = outputs

    assert _iterations(stop) == [1, 2, 3, 4, 5]
    assert any(re.match(_saved(5), line) for line in stop)
    assert " exiting program at iteration        5" in stop
    assert stop[-1].startswith(" training done: iteration 5 after ")
    assert stop[-1].endswith(
        "; outputs: timeline runs/tiny_gpt_cpu-dualpipev-train_iters=10/timeline.png, "
        "checkpoints in ckpt"
    )

    loaded = "  successfully loaded checkpoint from ckpt [ t 1/1, p 1/2 ] at iteration {}"
    assert ", 1f1b, PP=2 " in resume[0]
    assert resume.index(loaded.format(5)) < min(
        i for i, line in enumerate(resume) if re.match(rf"^ {STAMP} iteration", line)
    )
    assert _iterations(resume) == [6, 7, 8, 9, 10]
    assert any(re.match(_saved(10), line) for line in resume)
    assert resume[-1].startswith(" training done: iteration 10 after ")
    assert "runs/tiny_gpt_cpu-1f1b-train_iters=10/timeline.png" in resume[-1]

    assert again[-3:] == [
        loaded.format(10),
        " the checkpoint's iteration 10 already reached train_iters (10): nothing to train; to "
        "train further raise train_iters and choose the learning-rate schedule (e.g. --set "
        "train_iters=20 --set override_opt_param_scheduler=true)",
        again[-1],
    ]
    assert re.match(r"^ training done: iteration 10 after \d+\.\d s$", again[-1])
    assert _iterations(again) == []

    assert loaded.format(10) in further
    assert _iterations(further) == [11, 12, 13, 14, 15]
    assert any(re.match(_saved(15), line) for line in further)
    assert further[-1].startswith(" training done: iteration 15 after ")
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "15\n"
    further_run = "runs/tiny_gpt_cpu-dualpipev-override_opt_param_scheduler=true-train_iters=15"
    assert f"; outputs: timeline {further_run}/timeline.png" in further[-1]
    for run in ("dualpipev-train_iters=10", "1f1b-train_iters=10"):
        assert (tmp_path / "runs" / f"tiny_gpt_cpu-{run}" / "timeline.png").stat().st_size
