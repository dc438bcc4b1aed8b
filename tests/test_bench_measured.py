"""The measured section on a tiny configuration (PP=2, 4 micro-batches, 1 ms sleeps):
every schedule gives a row with positive times, ours measure the simulator's peak
activations, Megatron's rows run through Megatron's own schedule functions, and the
section writes its tables, figures and JSON. No timed assertions."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bench import measured as measured_mod
from bench import suite
from bench.__main__ import main
from bench.measured import (
    BASELINE,
    MEASURED_SCHEDULES,
    OPTIMISED,
    Calibration,
    MeasuredConfig,
    MeasuredRun,
    _round_order,
    measure,
    per_action_overhead_ms,
)
from bench.measured_report import (
    OURS,
    comparison_table,
    measured_table,
    memory_table,
    not_ahead,
)
from megatron_dualpipe.schedules import generate, simulate

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc, pytest.mark.slow]

TINY = MeasuredConfig(
    pp=2,
    microbatches=4,
    share_ms=2.0,  # 1 ms per layer and pass
    launches=1,
    steps=1,
    warmup=1,
    timeout_s=120.0,
    pg_timeout_s=30.0,
    schedules=tuple(MEASURED_SCHEDULES),  # with the optimised DualPipeV
    calibrate=True,
)


@functools.cache
def tiny_run() -> MeasuredRun:
    return measure(TINY)


def test_every_schedule_gives_a_row_with_positive_times() -> None:
    run = tiny_run()
    assert [r.schedule for r in run.results] == list(MEASURED_SCHEDULES)
    assert run.results[0].schedule == BASELINE and run.results[0].vs_baseline == 1.0
    for r in run.results:
        assert len(r.step_ms_all) == TINY.launches * TINY.steps
        assert r.step_ms > 0 and r.simulated_ms > 0 and r.vs_baseline > 0
        assert len(r.busy_ms) == len(r.bubble) == len(r.cpu_ms) == TINY.pp
        assert all(b > 0 for b in r.busy_ms)
        assert all(b < 1 for b in r.bubble)
        # Every runtime computed every micro-batch's loss on its last stage(s).
        assert r.losses == TINY.microbatches, r.schedule
    assert len(run.rounds) == TINY.launches * TINY.steps


def test_our_rows_measure_the_simulated_peak_activations() -> None:
    by_name = tiny_run().by_name()
    for name in OURS:
        r = by_name[name]
        assert r.runner == f"PipelineExecutor({name})"
        assert r.peak_activations == r.simulated_peak, name
    assert by_name["dualpipe"].param_factor == 2.0
    assert all(by_name[n].peak_activations is None for n in by_name if n not in OURS)


def test_megatron_rows_run_through_megatrons_own_schedule_functions() -> None:
    from megatron.core.pipeline_parallel import schedules

    by_name = tiny_run().by_name()
    for name, function in (
        ("megatron-1f1b", schedules.forward_backward_pipelining_without_interleaving),
        ("megatron-interleaved", schedules.forward_backward_pipelining_with_interleaving),
    ):
        assert by_name[name].runner == f"{function.__module__}.{function.__qualname__}"
    assert by_name["torch-dualpipev"].runner == "ScheduleDualPipeV"
    assert by_name["torch-zbv"].runner == "ScheduleZBVZeroBubble"


def test_the_recorded_timeline_is_the_schedule_the_executor_ran() -> None:
    run = tiny_run()
    assert run.timeline is not None and run.timeline_simulated is not None
    assert run.timeline.schedule.name == run.timeline_simulated.schedule.name
    assert run.timeline.makespan > 0
    measured = [r.peak_activations for r in run.timeline.ranks]
    assert measured == [r.peak_activations for r in run.timeline_simulated.ranks]


def test_tables_and_statements_name_every_schedule() -> None:
    run = tiny_run()
    text = measured_table(run) + comparison_table(run) + memory_table(run)
    for name in MEASURED_SCHEDULES:
        assert name in text
    statements = not_ahead(run, {"dualpipev": 1.0, "torch-zbv": 2.0})
    assert any("Sleep ops cannot show F&B overlap" in s for s in statements)
    assert any("Runtime overhead" in s for s in statements)


def test_rounds_start_at_a_different_schedule_each_time() -> None:
    names = ["a", "b", "c"]
    assert [_round_order(names, i)[0] for i in range(4)] == ["a", "b", "c", "a"]
    assert sorted(_round_order(names, 2)) == names


def test_the_run_is_calibrated_and_simulated_with_the_calibration() -> None:
    run = tiny_run()
    cal = run.calibration
    assert cal is not None and cal.latency_ms > 0 and cal.overhead_ms >= 0
    by_name = run.by_name()
    placement = generate("dualpipev", TINY.pp, TINY.microbatches).placement
    cost = TINY.cost_for(placement, cal)
    assert cost.latency == cal.latency_ms
    assert cost.stage_costs[0][0] == pytest.approx(TINY.share_ms / 2 + cal.overhead_ms)
    # An optimised order is never predicted slower than the hand-made one whose memory it
    # is given (and which it starts from).
    assert by_name[OPTIMISED].simulated_ms <= by_name["dualpipev"].simulated_ms + 1e-9
    assert by_name["zb1p-opt"].simulated_ms <= by_name["zb1p"].simulated_ms + 1e-9


def test_overhead_is_what_actions_take_beyond_their_nominal_time() -> None:
    schedule = generate("dualpipev", 2, 4)
    config = replace(TINY, end_scale=1.5)
    nominal = config.cost_for(schedule.placement)
    assert [c[0] for c in nominal.stage_costs] == [1.5, 1.0, 1.0, 1.5]  # ends x1.5, in ms
    slower = config.cost_for(schedule.placement, Calibration(latency_ms=0.1, overhead_ms=0.25))
    assert per_action_overhead_ms(simulate(schedule, slower), nominal) == pytest.approx(0.25)


def test_a_bad_configuration_fails_before_launching() -> None:
    with pytest.raises(ValueError, match="baseline"):
        measure(replace(TINY, schedules=("zb1p", BASELINE)))
    with pytest.raises(ValueError, match="do not split"):
        measure(replace(TINY, layers_per_share=1))  # V stages would need half a layer


def test_quick_leaves_out_peers_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    def fake(key):
        return lambda ctx: (ran.append(key), suite.Section(key, key, ""))[1]

    monkeypatch.setattr(suite, "SECTIONS", {k: fake(k) for k in suite.SECTIONS})
    suite.run(quick=True, progress=lambda line: None)
    assert "peers" not in ran and "measured" in ran
    ran.clear()
    suite.run(quick=True, sections=("peers",), progress=lambda line: None)
    assert ran == ["peers"]


def test_measured_section_writes_tables_figures_and_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(measured_mod, "QUICK", TINY)
    monkeypatch.setattr(measured_mod, "measure", lambda config, verbose=False: tiny_run())
    out, data = tmp_path / "out", tmp_path / "bench.json"
    argv = ["--quick", "--only", "measured", "--out", str(out), "--json", str(data)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "**Measured on sleep ops, PP=2" in printed
    doc = (out / "BENCHMARKS.md").read_text()
    assert "## Measured: Megatron-Core" in doc and "Where we are not ahead" in doc
    for png in ("bench_measured_dualpipev.png", "bench_measured_dualpipev_sim.png"):
        assert (out / png).stat().st_size > 0 and png in doc
    section = json.loads(data.read_text())["sections"]["measured"]
    assert [r["schedule"] for r in section["results"]] == list(MEASURED_SCHEDULES)
    assert "dualpipev / megatron-1f1b" in section["headline"]


@pytest.mark.megatron
@pytest.mark.multiproc
def test_the_measured_section_prints_no_warnings() -> None:
    """The smallest equivalent of ``python -m bench --quick``'s measured section (the one
    that runs megatron-core), in a fresh interpreter where pytest's warning filters do not
    apply: megatron-core's TE/apex-missing and deprecation warnings are hidden as in
    ``train``."""
    code = (
        "from bench.measured import MeasuredConfig, measure\n"
        "measure(MeasuredConfig(pp=2, microbatches=4, share_ms=2.0, launches=1, steps=1,"
        " warmup=1, schedules=('megatron-1f1b', 'megatron-interleaved', 'dualpipev'),"
        " timeline=None, timeout_s=120.0, pg_timeout_s=30.0))\n"
        "print('measured')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[1],
        stdin=subprocess.DEVNULL,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "measured" in done.stdout, output[-2000:]
    assert "Warning" not in output, output
