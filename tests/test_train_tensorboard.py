"""TensorBoard on Megatron-LM's intervals: a step's scalars every
``tensorboard_log_interval`` (that iteration's values), the timings every ``log_interval``
(the log line's), read back with tensorboard's ``EventAccumulator``. The slow real-data
test in test_train_real_data.py reads back every tag over 20 iterations."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import load_config, train
from megatron_dualpipe.planner.megatron_flops import megatron_lm_flops
from megatron_dualpipe.planner.model_cost import ModelShape

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"


@pytest.mark.slow
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
        "log_throughput=true",
    ]
    cfg = load_config(TINY, settings)
    result = train(cfg, source=str(TINY))
    # The run's own folder: five runs of one config with other settings are five runs.
    assert cfg.tensorboard_run_dir == str(board / cfg.run_name)
    assert cfg.run_name.startswith("tiny_gpt_cpu-") and "log_throughput" not in cfg.run_name
    assert [p.name for p in board.iterdir()] == [cfg.run_name]
    assert f"TensorBoard events in {board / cfg.run_name}" in result.lines[-1]
    events = EventAccumulator(cfg.tensorboard_run_dir)
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
    for tag in ("iteration-time", "throughput", "pipeline-bubble/rank-0", "pipeline-bubble/rank-1"):
        assert sorted(steps(tag)) == [3, 6], tag
    # Megatron-LM's --log-throughput: TFLOP/s per GPU on each log line, the same figure.
    lines = [line for line in result.lines if " iteration " in line and "lm loss" in line]
    printed = [float(line.split("throughput per GPU (TFLOP/s/GPU): ")[1].split(" ")[0])
               for line in lines]  # fmt: skip
    assert len(printed) == 2
    assert [round(v, 1) for v in steps("throughput").values()] == printed
    # FLOPs of an iteration (Megatron-LM's count) / (seconds per iteration x 1e12 x GPUs).
    flops = megatron_lm_flops(
        ModelShape(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=16,
                   vocab_size=128, max_position_embeddings=16),
        samples=16, padded_vocab_size=128,
    )  # fmt: skip
    seconds = steps("iteration-time")
    for i, tflops in steps("throughput").items():
        assert math.isclose(tflops, flops / (seconds[i] * 1e12 * 2), rel_tol=1e-5), i


def test_memory_scalars_are_megatron_lms_from_cuda_memory_stats(tmp_path: Path) -> None:
    """log_memory_to_tensorboard writes Megatron-LM's four tags from the entries of
    ``torch.cuda.memory_stats()`` it names (the GPU path itself has not run: no GPU)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_dualpipe.megatron.training.tensorboard import MEMORY_SCALARS, TensorBoardLog

    stats = {key: 1000 * (i + 1) for i, key in enumerate(MEMORY_SCALARS.values())}
    board = TensorBoardLog(str(tmp_path))
    board.memory(4, stats)
    board.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in MEMORY_SCALARS} == {
        "mem-reserved-bytes": [(4, 1000.0)],
        "mem-allocated-bytes": [(4, 2000.0)],
        "mem-max-allocated-bytes": [(4, 3000.0)],
        "mem-allocated-count": [(4, 4000.0)],
    }


def test_memory_scalars_need_a_tensorboard_dir() -> None:
    from megatron_dualpipe.megatron.training import ConfigError

    with pytest.raises(ConfigError, match="log_memory_to_tensorboard: needs tensorboard_dir"):
        load_config(TINY, ["log_memory_to_tensorboard=true"])
