"""``train`` under every pipeline schedule prints the same losses.

The tiny demo config (PP=2, 8 layers, 8 micro-batches) runs 10 iterations under 1f1b,
zb1p, dualpipe, dualpipev and interleaved-1f1b, each with the embedded launcher (two CPU
ranks forked from this process), with an evaluation (forward-only) at iteration 10. The
losses printed with 7 significant digits must agree. They are the same computation in a
different order: gradients are summed over micro-batches (and, under dualpipe, over the
two model copies) in a schedule-dependent order, so the fp32 values may differ by an ulp
or two (about 1e-8 relative). Where such a difference straddles a rounding boundary the
7th printed digit differs by one; the test allows exactly that (values within 1e-7
relative) and nothing more.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import load_config, train

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"
SCHEDULES = ("1f1b", "zb1p", "dualpipe", "dualpipev", "interleaved-1f1b")
ITERATIONS = 10
LINE = re.compile(
    r"^ iteration +(\d+)/ +10 \| consumed samples: +(\d+) \| "
    r"elapsed time per iteration \(ms\): \d+\.\d \| learning rate: \d\.\d{6}E[-+]\d\d \| "
    r"global batch size: +16 \| lm loss: (\d\.\d{6}E[-+]\d\d) \| loss scale: 1\.0 \| "
    r"grad norm: \d+\.\d{3} \| number of skipped iterations: +0 \| "
    r"number of nan iterations: +0 \|$"
)
VALIDATION = re.compile(r"^ validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def _run(schedule: str, output_dir: Path | None) -> dict:
    overrides = [
        f"pipeline_schedule={schedule}",
        f"train_iters={ITERATIONS}",
        "eval_interval=10",
        "eval_iters=1",
        f"output_dir={output_dir if output_dir else 'null'}",
    ]
    if schedule == "interleaved-1f1b":
        overrides.append("virtual_pipeline_model_parallel_size=2")
    result = train(load_config(TINY, overrides), source=str(TINY))
    printed = [m.groups() for m in map(LINE.match, result.lines) if m]
    validation = [m.groups() for m in map(VALIDATION.match, result.lines) if m]
    return {"result": result, "printed": printed, "validation": validation}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("train")
    return {s: _run(s, out if s == "dualpipev" else None) for s in SCHEDULES}


def _same_to_7_digits(a: float, b: float) -> bool:
    return f"{a:.6E}" == f"{b:.6E}" or abs(a - b) <= 1e-7 * abs(b)


def test_every_iteration_prints_megatrons_log_line(runs: dict[str, dict]) -> None:
    for schedule, run in runs.items():
        printed = run["printed"]
        assert [int(i) for i, _, _ in printed] == list(range(1, ITERATIONS + 1)), schedule
        assert [int(c) for _, c, _ in printed] == [16 * i for i in range(1, ITERATIONS + 1)]
        losses = run["result"].losses
        assert [loss for _, _, loss in printed] == [f"{losses[i]:.6E}" for i in sorted(losses)]


@pytest.mark.parametrize("schedule", SCHEDULES[1:])
def test_same_losses_as_1f1b(runs: dict[str, dict], schedule: str) -> None:
    reference, losses = runs["1f1b"]["result"].losses, runs[schedule]["result"].losses
    assert sorted(losses) == list(range(1, ITERATIONS + 1))
    different = {
        i: (f"{losses[i]:.6E}", f"{reference[i]:.6E}")
        for i in losses
        if not _same_to_7_digits(losses[i], reference[i])
    }
    assert not different, f"{schedule} vs 1f1b: {different}"
    assert losses[ITERATIONS] < losses[1]


@pytest.mark.parametrize("schedule", SCHEDULES[1:])
def test_same_validation_losses_as_1f1b(runs: dict[str, dict], schedule: str) -> None:
    reference = runs["1f1b"]["result"].validation
    validation = runs[schedule]["result"].validation
    assert sorted(validation) == [ITERATIONS]
    assert _same_to_7_digits(validation[ITERATIONS], reference[ITERATIONS])
    assert runs[schedule]["validation"] == [(str(ITERATIONS), f"{validation[ITERATIONS]:.6E}")]


def test_summary_of_the_measured_step(runs: dict[str, dict]) -> None:
    for schedule, run in runs.items():
        summary = run["result"].summary
        assert summary is not None and summary.schedule == schedule
        assert summary.iteration == ITERATIONS and len(summary.bubble) == 2
        assert all(0.0 <= b < 1.0 for b in (*summary.bubble, *summary.simulated_bubble))
        assert all(busy > 0 for busy in summary.busy_ms)
    dualpipev = runs["dualpipev"]["result"]
    assert dualpipev.summary.png is not None and Path(dualpipev.summary.png).stat().st_size > 0
    text = "\n".join(dualpipev.lines)
    assert "measured step: iteration 10, dualpipev, PP=2, 8 micro-batches" in text
    assert "pipeline rank 1: busy" in text and "(simulated " in text
