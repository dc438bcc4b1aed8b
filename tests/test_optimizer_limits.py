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
from megatron_dualpipe.planner.optimize import local_search, optimize
from megatron_dualpipe.planner.optimize.bound import tails
from megatron_dualpipe.planner.optimize.deadline import Deadline, OutOfTime
from megatron_dualpipe.planner.optimize.instance import Instance
from megatron_dualpipe.planner.optimize.listsched import build
from megatron_dualpipe.planner.optimize.local_search import improve
from megatron_dualpipe.planner.optimize.optimizer import PORTFOLIO
from megatron_dualpipe.planner.optimize.timing import from_actions, time_orders
from megatron_dualpipe.schedules import CostModel, generate

#: A size whose list-scheduler build takes about half a second here, a timing a quarter of it
#: (thousands of checks of the deadline each).
PP, MICROBATCHES = 16, 160


@pytest.fixture(scope="module")
def large() -> tuple[Instance, list]:
    schedule = generate("dualpipev", PP, MICROBATCHES)
    cost = CostModel(1, 1, 1).per_stage(PP, schedule.placement.num_model_stages)
    inst = Instance(schedule.placement, cost, (2 * PP + 1,) * PP)
    return inst, from_actions(inst, schedule.ranks)


class _PassesAtReading(Deadline):
    """A deadline whose clock reads as passed from its ``reading``-th reading on: a step's
    checks counted, not timed (the clock is read once every few hundred checks), so a
    loaded machine changes nothing."""

    def __init__(self, reading: int) -> None:
        super().__init__(0.0)
        self.reading, self.readings = reading, 0

    def passed(self) -> bool:
        self.readings += 1
        return self.readings >= self.reading


def test_the_list_scheduler_reads_the_clock(large) -> None:
    """A build checks its deadline as it goes and stops at the first reading of the clock
    that finds it passed (before, a build started ran to its end whatever the time)."""
    inst, _ = large
    deadline = _PassesAtReading(3)
    with pytest.raises(OutOfTime):
        build(inst, PORTFOLIO[0], tails(inst), deadline)
    assert deadline.readings == 3


def test_a_timing_reads_the_clock(large) -> None:
    inst, orders = large
    deadline = _PassesAtReading(3)
    with pytest.raises(OutOfTime):
        time_orders(inst, orders, deadline)
    assert deadline.readings == 3


def test_the_local_search_stops_inside_a_timing(large, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local search's timings check its deadline: one passed in the middle of its first
    timing ends the search with the best found so far (the starting orders)."""
    inst, orders = large
    timing = time_orders(inst, orders)
    clocks: list[_PassesAtReading] = []

    def passes_in_the_first_timing(at: float | None) -> _PassesAtReading:
        clocks.append(_PassesAtReading(2))
        return clocks[-1]

    monkeypatch.setattr(local_search, "Deadline", passes_in_the_first_timing)
    # An hour away, and 20 timings at most: only the timing's own check can end it at once.
    found, found_timing = improve(
        inst, orders, time.perf_counter() + 3600, timing=timing, evaluations=20
    )
    assert [clock.readings for clock in clocks] == [2]
    assert found == orders and found_timing is timing


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
    assert code == 2 and time.monotonic() - started < 2.5  # the search's limit: 3 s
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
