"""TensorBoard on Megatron-LM's intervals: a step's scalars every
``tensorboard_log_interval`` (that iteration's values), the timings every ``log_interval``
(the log line's), read back with tensorboard's ``EventAccumulator``. The slow real-data
test in test_train_real_data.py reads back every tag over 20 iterations."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import load_config, train

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"


def test_step_scalars_every_tensorboard_log_interval_timings_every_log_interval(
    tmp_path: Path,
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "board"
    settings = [
        "train_iters=6",
        "log_interval=3",
        "tensorboard_log_interval=2",
        "eval_interval=null",
        "output_dir=null",
        f"tensorboard_dir={board}",
    ]
    result = train(load_config(TINY, settings), source=str(TINY))
    events = EventAccumulator(str(board))
    events.Reload()

    def steps(tag: str) -> dict[int, float]:
        return {e.step: e.value for e in events.Scalars(tag)}

    lm_loss = steps("lm loss")
    assert sorted(lm_loss) == [2, 4, 6]
    # Each is that iteration's loss, not the mean of the log line's interval.
    assert all(math.isclose(lm_loss[i], result.losses[i], rel_tol=1e-6) for i in lm_loss)
    window = math.fsum(result.losses[i] for i in (4, 5, 6)) / 3
    assert not math.isclose(lm_loss[6], window, rel_tol=1e-6)
    for tag in ("learning-rate", "batch-size", "loss-scale", "grad-norm"):
        assert sorted(steps(tag)) == [2, 4, 6], tag
    assert sorted(steps("lm loss vs samples")) == [32, 64, 96]
    for tag in ("iteration-time", "pipeline-bubble/rank-0", "pipeline-bubble/rank-1"):
        assert sorted(steps(tag)) == [3, 6], tag
