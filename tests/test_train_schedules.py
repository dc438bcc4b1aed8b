"""``train`` under every pipeline schedule prints the same losses, and exactly what
"the same" means.

The tiny demo config (PP=2, 8 layers, 8 micro-batches) runs 20 iterations under 1f1b,
zb1p, dualpipe, dualpipev and interleaved-1f1b, each with the embedded launcher (two CPU
ranks forked from this process), with evaluations (forward-only) at iterations 10 and 20.

- With gradient clipping off (``clip_grad: 0``), 1f1b, zb1p, dualpipev and
  interleaved-1f1b compute every weight gradient with the same operations in the same
  order, so their printed losses are identical (``==``) at every iteration. dualpipe holds
  two model copies, each accumulating the gradients of half the micro-batches, summed
  afterwards: that fp32 sum rounds differently, so its losses agree within 1e-6 relative.
- With clipping on (the demo's ``clip_grad: 1.0``), the gradient norm is a float32 sum of
  each pipeline rank's partial sum of squares; which layers share a rank depends on the
  placement (dualpipev's V puts layers 1-2 and 7-8 on rank 0), so the norm, and with it the
  clipping factor, can differ in its last bit. From then on the runs differ by float32
  rounding: dualpipe's, dualpipev's and interleaved-1f1b's losses agree with 1f1b's within
  1e-6 relative (the 7th printed digit may differ); zb1p, placed as 1f1b, prints 1f1b's
  digits; and a schedule run twice prints the same digits (slow tests).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import load_config, train

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc, pytest.mark.slow]

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"
SCHEDULES = ("1f1b", "zb1p", "dualpipe", "dualpipev", "interleaved-1f1b")
SAME_ORDER = ("zb1p", "dualpipev", "interleaved-1f1b")  # bit-identical to 1f1b unclipped
ITERATIONS = 20
REL_TOL = 1e-6
LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +(\d+)/ +20 \| "
    r"consumed samples: +(\d+) \| "
    r"elapsed time per iteration \(ms\): \d+\.\d \| learning rate: \d\.\d{6}E[-+]\d\d \| "
    r"global batch size: +16 \| lm loss: (\d\.\d{6}E[-+]\d\d) \| loss scale: 1\.0 \| "
    r"grad norm: \d+\.\d{3} \| number of skipped iterations: +0 \| "
    r"number of nan iterations: +0 \|$"
)
VALIDATION = re.compile(r"^ validation loss at iteration (\d+) \| lm loss value: (\S+) \|")
PARAMETERS = re.compile(
    r"^ > number of parameters on \(tensor, pipeline\) model parallel rank \(0, (\d)\): (\d+)$"
)


def _run(schedule: str, output_dir: Path | None, *overrides: str) -> dict:
    settings = [
        f"pipeline_schedule={schedule}",
        f"train_iters={ITERATIONS}",
        f"output_dir={output_dir if output_dir else 'null'}",
        *overrides,
    ]
    if schedule == "interleaved-1f1b":
        settings.append("virtual_pipeline_model_parallel_size=2")
    result = train(load_config(TINY, settings), source=str(TINY))
    printed = [m.groups() for m in map(LINE.match, result.lines) if m]
    validation = [m.groups() for m in map(VALIDATION.match, result.lines) if m]
    return {"result": result, "printed": printed, "validation": validation}


@pytest.fixture(scope="module")
def unclipped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("train")
    evaluation = ("clip_grad=0", "eval_interval=10", "eval_iters=1")
    return {s: _run(s, out if s == "dualpipev" else None, *evaluation) for s in SCHEDULES}


@pytest.fixture(scope="module")
def clipped() -> dict[str, list[dict]]:
    """The demo as configured (clipping on): every schedule once, dualpipev twice."""
    return {
        s: [_run(s, None, "eval_interval=null") for _ in range(2 if s == "dualpipev" else 1)]
        for s in SCHEDULES
    }


def _printed_losses(run: dict) -> list[str]:
    return [loss for _, _, loss in run["printed"]]


def test_every_iteration_prints_megatrons_log_line(unclipped: dict[str, dict]) -> None:
    for schedule, run in unclipped.items():
        printed = run["printed"]
        assert [int(i) for i, _, _ in printed] == list(range(1, ITERATIONS + 1)), schedule
        assert [int(c) for _, c, _ in printed] == [16 * i for i in range(1, ITERATIONS + 1)]
        losses = run["result"].losses
        assert _printed_losses(run) == [f"{losses[i]:.6E}" for i in sorted(losses)]


def test_one_parameter_count_per_pipeline_rank(unclipped: dict[str, dict]) -> None:
    counts = {}
    for schedule, run in unclipped.items():
        found = [m.groups() for m in map(PARAMETERS.match, run["result"].lines) if m]
        assert [int(rank) for rank, _ in found] == [0, 1], schedule
        counts[schedule] = sum(int(n) for _, n in found)
    assert len({counts[s] for s in SCHEDULES if s != "dualpipe"}) == 1, counts
    assert counts["dualpipe"] == 2 * counts["1f1b"]  # two copies of every stage


@pytest.mark.parametrize("schedule", SAME_ORDER)
def test_unclipped_the_same_digits_as_1f1b(unclipped: dict[str, dict], schedule: str) -> None:
    reference, run = unclipped["1f1b"], unclipped[schedule]
    assert _printed_losses(run) == _printed_losses(reference)
    assert run["result"].losses == reference["result"].losses
    assert run["validation"] == reference["validation"]
    assert [i for i, _ in run["validation"]] == ["10", "20"]


def _relative_differences(losses: dict[int, float], reference: dict[int, float]) -> list[float]:
    assert sorted(losses) == sorted(reference)
    return [abs(losses[i] - reference[i]) / abs(reference[i]) for i in sorted(reference)]


def test_unclipped_dualpipe_within_a_millionth_of_1f1b(unclipped: dict[str, dict]) -> None:
    reference, run = unclipped["1f1b"]["result"], unclipped["dualpipe"]["result"]
    assert max(_relative_differences(run.losses, reference.losses)) <= REL_TOL
    assert max(_relative_differences(run.validation, reference.validation)) <= REL_TOL
    assert run.losses[ITERATIONS] < run.losses[1]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ("dualpipe", "dualpipev", "interleaved-1f1b"))
def test_clipped_within_a_millionth_of_1f1b(
    clipped: dict[str, list[dict]], schedule: str
) -> None:
    reference = clipped["1f1b"][0]["result"].losses
    for run in clipped[schedule]:
        assert max(_relative_differences(run["result"].losses, reference)) <= REL_TOL


@pytest.mark.slow
def test_clipped_zb1p_the_same_digits_as_1f1b(clipped: dict[str, list[dict]]) -> None:
    (reference,), (run,) = clipped["1f1b"], clipped["zb1p"]
    assert _printed_losses(run) == _printed_losses(reference)
    assert run["result"].losses == reference["result"].losses


@pytest.mark.slow
def test_each_schedule_reproduces_its_own_digits(clipped: dict[str, list[dict]]) -> None:
    first, second = clipped["dualpipev"]
    assert _printed_losses(first) == _printed_losses(second)
    assert first["result"].losses == second["result"].losses


def test_summary_of_the_measured_step(unclipped: dict[str, dict]) -> None:
    for schedule, run in unclipped.items():
        summary = run["result"].summary
        assert summary is not None and summary.schedule == schedule
        assert summary.iteration == ITERATIONS and len(summary.bubble) == 2
        assert all(0.0 <= b < 1.0 for b in (*summary.bubble, *summary.simulated_bubble))
        assert all(busy > 0 for busy in summary.busy_ms)
    dualpipev = unclipped["dualpipev"]["result"]
    assert dualpipev.summary.png is not None and Path(dualpipev.summary.png).stat().st_size > 0
    text = "\n".join(dualpipev.lines)
    assert f"measured step: iteration {ITERATIONS}, dualpipev, PP=2, 8 micro-batches" in text
    assert "pipeline rank 1: busy" in text and "(simulated " in text
    assert dualpipev.summary.bound_ms is not None
    assert dualpipev.summary.makespan_ms >= dualpipev.summary.bound_ms > 0
    assert f" compute bound {dualpipev.summary.bound_ms:.1f} ms (the measured F, B" in text
    assert dualpipev.lines[-1].startswith(f" training done: iteration {ITERATIONS} after ")
    assert dualpipev.lines[-1].endswith(f"; outputs: timeline {dualpipev.summary.png}")


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One MTP layer over learned absolute positions, clipping on, five iterations and a
    save at the last: PP=1 and every schedule at PP=2."""
    out = tmp_path_factory.mktemp("mtp")
    common = ["mtp_num_layers=1", "train_iters=5", "eval_interval=null", "output_dir=null"]
    runs = {}
    for name in ("pp1", *SCHEDULES):
        settings = [*common, f"save={out / name}"]
        if name == "pp1":
            settings += ["pipeline_schedule=1f1b", "pipeline_model_parallel_size=1", "world_size=1"]
        else:
            settings.append(f"pipeline_schedule={name}")
        if name == "interleaved-1f1b":
            settings.append("virtual_pipeline_model_parallel_size=2")
        runs[name] = train(load_config(TINY, settings), source=str(TINY))
    return runs


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mtp_with_learned_positions_matches_pp1(with_mtp: dict, schedule: str) -> None:
    """The MTP block's copy of the position table trains with the original (it was a second
    table on the last rank under 1f1b and zb1p, trained on the MTP loss alone, and its save
    failed), and leaves the gradient norm (dualpipe counted it twice)."""
    reference, run = with_mtp["pp1"], with_mtp[schedule]
    assert max(_relative_differences(run.losses, reference.losses)) <= REL_TOL
    mtp = {i: losses[0] for i, losses in run.mtp_losses.items()}
    expected = {i: losses[0] for i, losses in reference.mtp_losses.items()}
    assert max(_relative_differences(mtp, expected)) <= REL_TOL
    assert run.saved == [5]
