"""A NaN or Inf in the loss or the gradients stops training at once (Megatron-LM's
``check_for_nan_in_loss_and_grad``, on by default): one sentence naming the iteration, the
ranks and what was not finite; exit code 2; nothing of that state saved, the last good
checkpoint untouched. With the key off, training carries on as Megatron-LM's does.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.utils import unwrap_model

from megatron_dualpipe.megatron.training import TrainError, finite, load_config, loop, train
from megatron_dualpipe.megatron.training.report import validation_lines
from tests.processes import OUR_LOOP

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_gpt_cpu.yaml"
#: lr 1e6 makes iteration 3's loss 3e12 and iteration 4's NaN on the tiny config.
DIVERGING = ["lr=1e6", "min_lr=0", "eval_interval=null", "output_dir=null"]


@pytest.mark.slow
def test_a_diverging_run_stops_at_the_first_nan_and_keeps_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    save = tmp_path / "ckpt"
    sets = [*DIVERGING, "train_iters=8", f"save={save}", "save_interval=2"]
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(TINY), *OUR_LOOP]
        + [arg for item in sets for arg in ("--set", item)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "megatron-dualpipe: error: iteration 4: found NaN in the loss on rank 0 and NaN in the "
        "gradients on ranks 0, 1 (check_for_nan_in_loss_and_grad): stopped before the optimizer "
        f"step and saved nothing (the last checkpoint is iteration 2 in {save}); lower lr (1e+06) "
        "or clip_grad, or set check_for_nan_in_loss_and_grad: false to carry on regardless"
    ]
    assert " iteration        3/       8 |" in proc.stdout
    assert " iteration        4/" not in proc.stdout
    assert sorted(p.name for p in save.iterdir()) == [
        "iter_0000002",
        "latest_checkpointed_iteration.txt",
    ]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2\n"


@pytest.mark.slow
def test_with_the_check_off_training_carries_on_as_megatron_does() -> None:
    cfg = load_config(TINY, [*DIVERGING, "train_iters=5", "check_for_nan_in_loss_and_grad=false"])
    result = train(cfg, source=str(TINY))
    assert sorted(result.losses) == [1, 2, 3, 4, 5]
    assert math.isnan(result.losses[5])
    (last_log,) = [line for line in result.lines if "] iteration        5/" in line]
    assert last_log.endswith(" number of nan iterations:   1 |")


@pytest.mark.slow
def test_a_validation_nan_stops_before_anything_is_saved(tmp_path: Path) -> None:
    cfg = load_config(
        TINY, [*DIVERGING, "train_iters=6", "eval_interval=3", "eval_iters=1", f"save={tmp_path}"]
    )
    with pytest.raises(
        TrainError,
        match=r"^validation at iteration 3: found NaN in the loss on "
        r"rank 0 \(check_for_nan_in_loss_and_grad\): stopped and saved nothing "
        r"\(no checkpoint was saved\);",
    ):
        train(cfg, source=str(TINY))
    assert list(tmp_path.iterdir()) == []


def _nan_gradient_on_rank_0_in_iteration_2(data_iterator, model):
    """The real forward step; on rank 0's first stage in iteration 2, the gradient arriving
    at the stage's output becomes NaN (the loss stays finite)."""
    output, loss_func = _REAL_FORWARD_STEP(data_iterator, model)
    if os.environ["RANK"] == "0" and unwrap_model(model).pre_process:
        _CALLS.append(1)
        if len(_CALLS) == 9:  # 8 micro-batches per iteration: the first of iteration 2
            output.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    return output, loss_func


_REAL_FORWARD_STEP = loop.forward_step
_CALLS: list[int] = []


def test_a_nan_gradient_with_a_finite_loss_names_the_rank(monkeypatch) -> None:
    monkeypatch.setattr(loop, "forward_step", _nan_gradient_on_rank_0_in_iteration_2)
    cfg = load_config(TINY, ["train_iters=3", "eval_interval=null", "output_dir=null"])
    with pytest.raises(
        TrainError,
        match=r"^iteration 2: found NaN in the gradients on rank 0 "
        r"\(check_for_nan_in_loss_and_grad\): stopped before the optimizer step",
    ):
        train(cfg, source=str(TINY))


def test_findings_read_as_one_phrase() -> None:
    assert finite.describe([[0, 0, 0, 0], [0, 0, 0, 0]]) is None
    assert finite.describe([[0, 1, 0, 0], [0, 0, 0, 0]]) == "Inf in the loss on rank 0"
    assert finite.describe([[1, 0, 0, 1], [0, 0, 1, 1], [0, 0, 1, 0]]) == (
        "NaN in the loss on rank 0, NaN in the gradients on ranks 1, 2 and Inf in the gradients "
        "on ranks 0, 1"
    )
    assert finite.local_flags([1.0, float("inf")], [torch.tensor([1.0, float("nan")])]) == [
        0, 1, 1, 0,
    ]  # fmt: skip


class _Scaler:
    pass


class _Optimizer:
    def __init__(self, grad_scaler=None, chained=None):
        self.grad_scaler, self.chained_optimizers = grad_scaler, chained


def test_gradients_are_left_to_the_optimizer_under_loss_scaling() -> None:
    """Under dynamic loss scaling an Inf gradient is an overflow the optimizer skips."""
    assert not finite.uses_loss_scaling(_Optimizer())
    assert finite.uses_loss_scaling(_Optimizer(_Scaler()))
    assert finite.uses_loss_scaling(_Optimizer(chained=[_Optimizer(), _Optimizer(_Scaler())]))


def test_a_nan_validation_loss_has_no_finite_perplexity() -> None:
    """It printed exp(20) = 4.85e8 for a NaN loss (the check off lets one through)."""
    assert "| lm loss PPL: NAN |" in validation_lines(3, float("nan"))[1]
    assert "| lm loss PPL: 4.851652E+08 |" in validation_lines(3, 25.0)[1]  # capped, as before
