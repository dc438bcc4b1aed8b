"""Megatron-LM's own training loop, run for real: ``megatron.training.pretrain`` from the
installed megatron-core wheel (0.19 ships ``megatron/training``), copied to a temporary
folder and patched with the ``megatron/training`` hunks of
``patches/megatron-lm-core_v0.19.0.patch``, driven by ``scripts/pretrain_gpt_megatron_lm.py``
with ``--mock-data`` on 2 forked CPU ranks over gloo (the CPU compatibility layer and
:mod:`~megatron_dualpipe.megatron.cpu_compat_training` applied).

Megatron-LM seeds each pipeline rank differently (``seed + 100 * pp_rank``), so a schedule
that places layers elsewhere starts from other random weights: every run here starts from
one checkpoint, saved by Megatron's 1F1B after its first iteration. From it, with
dropout and gradient clipping off, ``--pipeline-schedule`` zb1p and dualpipev print 1F1B's
digits at every iteration and evaluation, and dualpipe (two model copies, each summing
half the micro-batches' gradients) agrees within one part in a million; a checkpoint that
dualpipev saves mid-run resumes under 1F1B with 1F1B's digits.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import megatron.core
import pytest

from megatron_dualpipe.megatron.version import installed_megatron_core
from tests.multiproc import run_workers

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "pretrain_gpt_megatron_lm.py"
PATCH = ROOT / "patches" / "megatron-lm-core_v0.19.0.patch"
WHEEL_TRAINING = Path(megatron.core.__file__).resolve().parents[1] / "training"
ITERATIONS = 5
REL_TOL = 1e-6
#: A tiny GPT at PP=2 (4 micro-batches: dualpipe and dualpipev need 2 x PP), fp32, no
#: dropout, no clipping, no fused kernels; a validation every 2 iterations.
ARGS = (
    "--pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 32 --num-attention-heads 4 "
    "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 "
    f"--train-iters {ITERATIONS} --lr 1e-3 --lr-decay-iters {ITERATIONS} --clip-grad 0 "
    "--hidden-dropout 0 --attention-dropout 0 --seed 1234 --untie-embeddings-and-output-weights "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --transformer-impl local "
    "--no-persist-layer-norm --no-gradient-accumulation-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --no-masked-softmax-fusion --no-rope-fusion "
    "--distributed-backend gloo --log-interval 1 --eval-interval 2 --eval-iters 1"
).split()
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: (\d\.\d{6}E[-+]\d\d) \|")
VALIDATION = re.compile(
    r"validation loss at iteration (\d+) \| lm loss value: (\d\.\d{6}E[-+]\d\d)"
)

if not WHEEL_TRAINING.is_dir() or not installed_megatron_core().startswith("0.19."):
    pytest.skip(
        f"megatron-core {installed_megatron_core()} is installed: this test runs the "
        "megatron/training that the 0.19 wheel ships",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def patched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the wheel's megatron/training with the patch's hunks for it applied."""
    root = tmp_path_factory.mktemp("megatron-lm")
    shutil.copytree(
        WHEEL_TRAINING, root / "megatron" / "training", ignore=shutil.ignore_patterns("__pycache__")
    )
    for check in (["--check"], []):
        done = subprocess.run(
            ["git", "apply", *check, "--include=megatron/training/*", str(PATCH)],
            cwd=root, capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    return root


def _rank(rank: int, world_size: int, copy: str, argv: list[str]) -> str:
    """One rank of ``pretrain``: Megatron-LM's printed lines."""
    sys.path.insert(0, copy)  # megatron.training resolves to the patched copy
    from megatron_dualpipe.megatron.cpu_compat_training import megatron_training_on_cpu

    spec = importlib.util.spec_from_file_location("pretrain_gpt_megatron_lm", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), megatron_training_on_cpu():
        try:
            script.main(argv)
        except SystemExit as stop:  # --exit-interval ends the run with exit code 0
            if stop.code not in (0, None):
                raise
    assert sys.modules["megatron.training"].__file__.startswith(copy)  # the patched copy ran
    return printed.getvalue()


def _pretrain(patched: Path, *extra: str) -> dict[str, dict[int, str]]:
    """Run ``pretrain`` on 2 forked ranks; the printed training and validation losses."""
    printed = "".join(
        run_workers(_rank, 2, args=(str(patched), ARGS + list(extra)), timeout_s=240.0,
                    pg_timeout_s=60.0)
    )  # fmt: skip
    return {
        "train": {int(i): loss for i, loss in LOSS.findall(printed)},
        "validation": {int(i): loss for i, loss in VALIDATION.findall(printed)},
    }


@pytest.fixture(scope="module")
def start(patched: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Megatron's 1F1B after one iteration, saved: where every run below starts."""
    ckpt = tmp_path_factory.mktemp("start")
    _pretrain(patched, "--save", str(ckpt), "--save-interval", "100", "--exit-interval", "1")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    return ckpt


@pytest.fixture(scope="module")
def runs(patched: Path, start: Path) -> dict[str, dict[str, dict[int, str]]]:
    found = {}
    for schedule in ("1f1b", "zb1p", "dualpipev", "dualpipe"):
        ours = [] if schedule == "1f1b" else ["--pipeline-schedule", schedule]
        found[schedule] = _pretrain(patched, "--load", str(start), *ours)
        print(f"\n{schedule}: {found[schedule]}")
    return found


def test_1f1b_prints_every_iteration_and_evaluation(runs: dict) -> None:
    assert sorted(runs["1f1b"]["train"]) == list(range(2, ITERATIONS + 1))
    assert sorted(runs["1f1b"]["validation"]) == [2, 4]


@pytest.mark.parametrize("schedule", ["zb1p", "dualpipev"])
def test_the_same_digits_as_1f1b(runs: dict, schedule: str) -> None:
    assert runs[schedule] == runs["1f1b"]


def test_dualpipe_within_a_millionth_of_1f1b(runs: dict) -> None:
    for kind in ("train", "validation"):
        ours, megatrons = runs["dualpipe"][kind], runs["1f1b"][kind]
        assert sorted(ours) == sorted(megatrons)
        for i, loss in megatrons.items():
            assert abs(float(ours[i]) - float(loss)) <= REL_TOL * float(loss), (kind, i)


def _save_at_3_and_resume_under_1f1b(patched: Path, start: Path, saved: Path, *ours: str) -> tuple:
    """Train from ``start`` under ``ours`` to iteration 3 with a checkpoint there, then go
    on from it to the end under 1F1B; both runs' losses."""
    first = _pretrain(
        patched, "--load", str(start), *ours,
        "--save", str(saved), "--save-interval", "100", "--exit-interval", "3",
    )  # fmt: skip
    return first, _pretrain(patched, "--load", str(saved))


def test_a_dualpipev_checkpoint_resumes_under_1f1b(
    patched: Path, start: Path, runs: dict, tmp_path: Path
) -> None:
    """Against 1F1B resumed from its own checkpoint of iteration 3: Megatron-LM's resume is
    not bit-exact against the uninterrupted run here (1F1B alone: iteration 5 prints
    4.746881E+00 resumed, 4.733436E+00 uninterrupted), the same under both schedules."""
    dualpipev = _save_at_3_and_resume_under_1f1b(
        patched, start, tmp_path / "dualpipev", "--pipeline-schedule", "dualpipev"
    )
    megatrons = _save_at_3_and_resume_under_1f1b(patched, start, tmp_path / "1f1b")
    assert (
        dualpipev[0]["train"]
        == megatrons[0]["train"]
        == {i: runs["1f1b"]["train"][i] for i in (2, 3)}
    )
    assert sorted(dualpipev[1]["train"]) == [4, 5]
    assert dualpipev[1] == megatrons[1]
    assert dualpipev[1]["train"][4] == runs["1f1b"]["train"][4]
