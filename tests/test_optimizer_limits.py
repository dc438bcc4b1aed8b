"""The optimiser keeps its time limit inside every step, not only between steps, refuses
what it cannot hold in memory before any work, and says when the limit cut the search.

Before, ``simulate --schedule dualpipev --pp 500 --microbatches 4000 --optimize
--time-limit 3`` ran 575 s ("solve 446.80 s") and peaked at 13.6 GB: a list-scheduler build
started whatever the time, and its loop, a timing and the local search's timings read no
clock.
"""

from __future__ import annotations

import time

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.planner.optimize import optimize
from megatron_dualpipe.planner.optimize.bound import tails
from megatron_dualpipe.planner.optimize.deadline import Deadline, OutOfTime
from megatron_dualpipe.planner.optimize.instance import Instance
from megatron_dualpipe.planner.optimize.listsched import build
from megatron_dualpipe.planner.optimize.local_search import improve
from megatron_dualpipe.planner.optimize.optimizer import PORTFOLIO
from megatron_dualpipe.planner.optimize.timing import from_actions, time_orders
from megatron_dualpipe.schedules import CostModel, generate

#: A size whose list-scheduler build takes about half a second here, a timing a quarter of it.
PP, MICROBATCHES = 16, 160
#: How long past its deadline a step may run: the clock is read every few hundred events.
LATE_S = 0.2


@pytest.fixture(scope="module")
def large() -> tuple[Instance, list]:
    schedule = generate("dualpipev", PP, MICROBATCHES)
    cost = CostModel(1, 1, 1).per_stage(PP, schedule.placement.num_model_stages)
    inst = Instance(schedule.placement, cost, (2 * PP + 1,) * PP)
    return inst, from_actions(inst, schedule.ranks)


def _late(step, seconds: float = 0.02) -> float:
    """How long after a deadline ``seconds`` from now ``step(deadline)`` raised
    :class:`OutOfTime` (the test fails if it finished instead)."""
    deadline = Deadline(time.perf_counter() + seconds)
    with pytest.raises(OutOfTime):
        step(deadline)
    return time.perf_counter() - deadline.at


def test_the_list_scheduler_reads_the_clock(large) -> None:
    inst, _ = large
    assert _late(lambda d: build(inst, PORTFOLIO[0], tails(inst), d)) < LATE_S


def test_a_timing_reads_the_clock(large) -> None:
    inst, orders = large
    assert _late(lambda d: time_orders(inst, orders, d), seconds=0.005) < LATE_S


def test_the_local_search_stops_inside_a_timing(large) -> None:
    inst, orders = large
    timing = time_orders(inst, orders)
    deadline = time.perf_counter() + 0.05
    found, found_timing = improve(inst, orders, deadline, timing=timing)
    assert time.perf_counter() - deadline < LATE_S
    assert found_timing.makespan <= timing.makespan


def test_no_build_starts_once_the_time_is_up_and_the_summary_says_so(capsys) -> None:
    code = main(
        [
            "simulate",
            "--schedule",
            "dualpipev",
            "--pp",
            str(PP),
            "--microbatches",
            str(MICROBATCHES),
            "--optimize",
            "--time-limit",
            "0.1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "the time limit (0.1 s) cut the search short: built 0 of " in out, out
    assert " list-scheduler orders, no local search; the search stopped after " in out


def test_the_result_of_a_cut_search_is_the_warm_start_simulated_once() -> None:
    schedule = generate("dualpipev", PP, MICROBATCHES)
    cost = CostModel(1, 1, 1).per_stage(PP, schedule.placement.num_model_stages)
    result = optimize(schedule.placement, cost, time_limit=0.01)
    assert result.fell_back and result.cut
    assert result.baseline_result is result.result  # not simulated a second time
    assert result.search_seconds < result.solve_seconds


def test_what_does_not_fit_in_memory_is_refused_before_any_work(capsys) -> None:
    started = time.monotonic()
    code = main(
        ["simulate", "--schedule", "dualpipev", "--pp", "500", "--microbatches", "4000"]
        + ["--optimize", "--time-limit", "3"]
    )
    assert code == 2 and time.monotonic() - started < 1.0
    assert capsys.readouterr().err == (
        "megatron-dualpipe: error: optimising PP=500 x 4000 micro-batches would take about "
        "13.4 GB (about 7 KB per PP x micro-batch): the optimiser takes PP x micro-batches up "
        "to 300,000 (about 2 GB): lower --pp or --microbatches\n"
    )


def test_the_callers_schedule_is_not_generated_again_and_figures_alone_are_kept() -> None:
    """``simulate --optimize --time-limit 3`` at the optimiser's bound (PP=100 x 3000) took
    22 s, 5.8 s of it searching: the command's schedule was generated a second time by the
    optimiser, and the result and 1F1B's reference were simulated keeping every action's
    times that nothing printed."""
    schedule = generate("dualpipev", PP, MICROBATCHES)
    cost = CostModel(1, 1, 1).per_stage(PP, schedule.placement.num_model_stages)
    result = optimize(
        schedule.placement, cost, time_limit=0.01, generated=[schedule], timeline=False
    )
    assert result.baseline is schedule
    assert not result.result.messages and not any(r.actions for r in result.result.ranks)
