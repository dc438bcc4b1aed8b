"""``megatron-dualpipe patch-megatron-lm`` makes the patched ``megatron/training`` of the
installed wheel, and ``scripts/pretrain_gpt_megatron_lm.py`` refuses an unpatched one in
one sentence before any work (it would train Megatron's 1F1B whatever
``--pipeline-schedule`` says). The script runs in a subprocess: the test process must not
import a ``megatron.training`` (tests/test_megatron_lm_loop.py's forked ranks import the
patched copy)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import megatron.core
import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.megatron.compat.version import installed_megatron_core

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "pretrain_gpt_megatron_lm.py"
WHEEL = Path(megatron.core.__file__).parents[1]  # as the script names it: unresolved
SHIPS_TRAINING = (WHEEL / "training" / "training.py").is_file()


@pytest.mark.skipif(not SHIPS_TRAINING, reason="the megatron-core wheel ships no megatron/training")
def test_the_command_writes_the_patched_training_and_refuses_to_overwrite_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["patch-megatron-lm", "--out", str(tmp_path)]) == 0
    training = tmp_path / "megatron" / "training"
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {training}, patched with megatron-lm-core_v0.1")
    assert f"PYTHONPATH={tmp_path.resolve()} torchrun" in said
    source = (training / "training.py").read_text(encoding="utf-8")
    assert "dualpipe_lm.forward_backward_func(args, forward_backward_func)" in source
    assert "apply_pipeline_schedule" in (training / "arguments.py").read_text(encoding="utf-8")
    assert not (tmp_path / "pretrain_gpt.py").exists()  # those hunks are for a checkout

    assert main(["patch-megatron-lm", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"megatron-dualpipe: error: {training} exists already: remove it, or choose another "
        "--out\n"
    )


@pytest.mark.skipif(not SHIPS_TRAINING, reason="the megatron-core wheel ships no megatron/training")
def test_the_command_patches_a_copy_inside_a_git_work_tree(tmp_path: Path) -> None:
    """``--out`` inside a git work tree (the checkout of a project, say): ``git apply`` run
    there takes the patch's paths from the work tree's top and skips them all, which left
    an unpatched copy behind a success."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    out = tmp_path / "lm"
    assert main(["patch-megatron-lm", "--out", str(out)]) == 0
    source = (out / "megatron" / "training" / "training.py").read_text(encoding="utf-8")
    assert "dualpipe_lm.forward_backward_func(args, forward_backward_func)" in source


@pytest.mark.skipif(SHIPS_TRAINING, reason="this megatron-core wheel ships megatron/training")
def test_a_wheel_without_megatron_training_is_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["patch-megatron-lm", "--out", str(tmp_path)]) == 2
    version = installed_megatron_core()
    assert capsys.readouterr().err == (
        f"megatron-dualpipe: error: the megatron-core {version} installed at {WHEEL} ships no "
        f"megatron/training (0.17 and newer do): apply {ROOT}/patches/megatron-lm-core_v0.16.1"
        ".patch to a Megatron-LM checkout of tag core_v0.16.1 instead (git apply), or pip "
        "install 'megatron-core==0.19.2'\n"
    )
    assert not (tmp_path / "megatron").exists()


def _script(*args: str, path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (path, ROOT) if p is not None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.route
def test_the_script_refuses_the_wheels_unpatched_training_in_one_sentence() -> None:
    done = _script("--pipeline-schedule", "dualpipev", "--mock-data")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        f"error: the megatron/training at {WHEEL / 'training'} is not patched for "
        "--pipeline-schedule (it would train Megatron's own schedule whatever the flag says): "
        "make a patched copy with `megatron-dualpipe patch-megatron-lm --out DIR` and put DIR "
        "first on PYTHONPATH, or apply patches/megatron-lm-core_v0.19.0.patch to a "
        "Megatron-LM checkout of core_v0.19.0"
    )
    assert "iteration" not in done.stdout


#: The fewest of Megatron-LM's arguments its validation takes (one rank, no pipeline).
MINIMAL = [
    *("--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"),
    *("--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1"),
    *("--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "64"),
    *("--distributed-backend", "gloo"),
]


@pytest.mark.slow
@pytest.mark.route
def test_the_script_takes_the_commands_patched_copy_and_refuses_te_without_te(
    tmp_path: Path,
) -> None:
    """With the command's copy first on the path the script passes the check and parses
    Megatron-LM's arguments; Transformer Engine (Megatron-LM's default transformer_impl)
    is not installed here, which it refuses in one sentence before any work. (Megatron-LM
    0.19's own --help fails: the help of --moe-paged-stash-buffer-size-factor-cuda holds a
    bare %.)"""
    assert main(["patch-megatron-lm", "--out", str(tmp_path)]) == 0
    done = _script(*MINIMAL, path=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        "error: --transformer-impl transformer_engine (Megatron-LM's default) needs "
        "Transformer Engine, which is not installed: pip install -e '.[te]' on a machine with "
        "CUDA, or pass --transformer-impl local"
    )
