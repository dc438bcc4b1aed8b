"""Checkpoints are layout-agnostic: saved under one pipeline schedule, resumed under
another, training continues exactly as if it had not been interrupted.

The tiny demo config runs 10 iterations under dualpipev without interruption. A second
run stops at iteration 5 (``exit_interval``) with a checkpoint; it is resumed under
1f1b and under dualpipe (which holds every stage twice, loaded from one saved copy), and,
the other way round, a checkpoint saved under dualpipe at iteration 5 is resumed under
dualpipev. The losses of iterations 6-10 (model, optimizer state, learning-rate schedule
and data position all restored) must agree with the uninterrupted run's within the
tolerance of clipped runs across placements (tests/digits.py: the demo clips, and which
layers share a rank sets the gradient norm's last bit); resumed under the schedule it was
saved under, a run prints the uninterrupted run's digits exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.checkpoint.files import CheckpointError
from megatron_dualpipe.megatron.training import load_config, train
from tests.digits import beyond, printed_differently

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc, pytest.mark.slow]

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"
ITERATIONS, SAVED_AT = 10, 5


def _run(schedule: str, *overrides: str):
    cfg = load_config(
        TINY,
        [
            f"pipeline_schedule={schedule}",
            f"train_iters={ITERATIONS}",
            "eval_interval=null",
            "output_dir=null",
            *overrides,
        ],
    )
    return train(cfg, source=str(TINY))


@pytest.fixture(scope="module")
def uninterrupted() -> dict[int, float]:
    return _run("dualpipev").losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoint directories saved at iteration 5 under dualpipev and dualpipe."""
    roots = {}
    for schedule in ("dualpipev", "dualpipe"):
        root = tmp_path_factory.mktemp(schedule)
        result = _run(schedule, f"exit_interval={SAVED_AT}", f"save={root}")
        assert sorted(result.losses) == list(range(1, SAVED_AT + 1))
        assert result.saved == [SAVED_AT]
        assert any(f" exiting program at iteration {SAVED_AT:8d}" == ln for ln in result.lines)
        saved_line = re.compile(
            rf"^  \[\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{{6}}\] successfully saved checkpoint "
            rf"from iteration {SAVED_AT:7d} to {re.escape(str(root))} \[ t 1/1, p 1/2 \]$"
        )
        assert sum(bool(saved_line.match(line)) for line in result.lines) == 1
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVED_AT)
        roots[schedule] = root
    return roots


@pytest.mark.parametrize(
    ("saved_under", "resumed_under"),
    [("dualpipev", "1f1b"), ("dualpipev", "dualpipe"), ("dualpipe", "dualpipev")],
)
def test_resume_under_another_schedule(
    uninterrupted: dict[int, float],
    saved: dict[str, Path],
    saved_under: str,
    resumed_under: str,
) -> None:
    result = _run(resumed_under, f"load={saved[saved_under]}")
    assert result.resumed_from == SAVED_AT
    assert sorted(result.losses) == list(range(SAVED_AT + 1, ITERATIONS + 1))
    different = beyond(result.losses, uninterrupted)
    assert not different, f"{saved_under} -> {resumed_under}: {different}"
    loaded = f"  successfully loaded checkpoint from {saved[saved_under]} [ t 1/1, p 1/2 ] "
    assert loaded + f"at iteration {SAVED_AT}" in result.lines


def test_resume_under_the_same_schedule_prints_the_same_digits(
    uninterrupted: dict[int, float], saved: dict[str, Path]
) -> None:
    result = _run("dualpipev", f"load={saved['dualpipev']}")
    assert sorted(result.losses) == list(range(SAVED_AT + 1, ITERATIONS + 1))
    assert not printed_differently(result.losses, uninterrupted)
    assert result.losses == {i: uninterrupted[i] for i in result.losses}


def test_a_checkpoint_only_loads_into_the_same_model(saved: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError) as info:
        _run("dualpipev", f"load={saved['dualpipev']}", "hidden_size=32")
    directory = saved["dualpipev"] / f"iter_{SAVED_AT:07d}"
    assert str(info.value) == (
        f"{directory}: the checkpoint was saved with hidden_size 64 but the config has 32: a "
        "checkpoint only loads into the same model"
    )


def test_no_checkpoint_yet_starts_from_scratch(tmp_path: Path) -> None:
    result = _run("dualpipev", f"load={tmp_path}", "train_iters=1", "lr_warmup_iters=0")
    assert result.resumed_from is None and sorted(result.losses) == [1]
    assert f" no checkpoint under {tmp_path}: training from scratch" in result.lines
