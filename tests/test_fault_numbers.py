"""Every number ``simulate`` takes is checked finite and in range, in one sentence, before
any work. Before, ``--latency nan`` printed a makespan of 30.00 and a bubble of 0.0%
(latency 0 gives 33.00 and 9.1%) and exited 0; ``--cost F=nan``, ``overlap=nan``, ``F=inf``
and ``--time-limit nan`` printed figures too, and ``--memory-cap nan`` was a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.schedules import CostModel, ScheduleError

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--latency", "nan"], "--latency must be a finite number >= 0, got nan"),
        (["--latency", "inf"], "--latency must be a finite number >= 0, got inf"),
        (["--cost", "F=nan"], "cost F must be a finite number from 0 to 1e+100, got nan"),
        (["--cost", "F=inf"], "cost F must be a finite number from 0 to 1e+100, got inf"),
        (
            ["--cost", "F=1,B=1,W=1,overlap=nan"],
            "cost overlap must be a finite number from 0 to 1e+100, got nan",
        ),
        (["--cost", "F=1e308"], "cost F must be a finite number from 0 to 1e+100, got 1e+308"),
        (
            ["--cost", "F=0,B=0,W=0"],
            "cost 'F=0,B=0,W=0' gives F, B and W no time, so no schedule takes any: give at "
            "least one of them a positive time",
        ),
        (
            ["--optimize", "--time-limit", "nan"],
            "--time-limit must be a finite number > 0, got nan",
        ),
        (
            ["--optimize", "--time-limit", "inf"],
            "--time-limit must be a finite number > 0, got inf",
        ),
        (
            ["--optimize", "--memory-cap", "nan"],
            "--memory-cap must be a finite number > 0, got nan",
        ),
        (
            ["--config", str(TINY), "--memory-cap", "nan"],
            "--memory-cap must be a finite number > 0, got nan",
        ),
        (["--pp", "0"], "--pp must be a whole number >= 1, got 0"),
        (["--microbatches", "-3"], "--microbatches must be a whole number >= 1, got -3"),
        (
            ["--schedule", "interleaved-1f1b", "--chunks", "0"],
            "--chunks must be a whole number >= 1, got 0",
        ),
        (
            ["--schedule", "interleaved-1f1b", "--chunks", "1", "--microbatches", "8"],
            "interleaved-1f1b needs --chunks >= 2 (use 1f1b for one chunk), got 1",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_number_out_of_range_is_one_sentence(capsys, args: list[str], message: str) -> None:
    assert main(["simulate", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"megatron-dualpipe: error: {message}\n"
    assert captured.out == ""


def test_the_cost_model_refuses_what_the_command_line_cannot_give() -> None:
    with pytest.raises(ScheduleError, match=r"^rank_scale must hold finite numbers"):
        CostModel(rank_scale=(1.0, float("nan")))
    with pytest.raises(ScheduleError, match=r"^each per-stage cost must be three times"):
        CostModel(stage_costs=((1.0, float("inf"), 1.0),))
