"""The train summary's "simulated" bubble runs each model stage with its own measured times
(under dualpipev rank 0 holds the embedding, the output layer and the loss: its two stages
cost more than rank 1's), and the footnote names the placement when it makes a rank the
long one."""

from __future__ import annotations

import pytest

from megatron_dualpipe.schedules.cost import CostModel
from megatron_dualpipe.schedules.registry import generate
from megatron_dualpipe.schedules.simulate import SimResult, simulate

pytestmark = pytest.mark.megatron

#: dualpipev at PP=2: model stages 0 and 3 on rank 0 (embedding; output layer and loss),
#: 1 and 2 on rank 1. F, B, W of each, as a measured step would time them.
COSTS = ((3.0, 3.0, 2.0), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), (4.0, 4.0, 2.0))


def _measured(costs: tuple[tuple[float, float, float], ...]) -> SimResult:
    """A 'measured' dualpipev step whose actions took ``costs`` (the simulator's step with
    them, with the kinds' mean times as the fitted cost a gathered timeline carries)."""
    schedule = generate("dualpipev", 2, 4)
    ran = simulate(schedule, CostModel(stage_costs=costs))
    means = [sum(c[i] for c in costs) / len(costs) for i in range(3)]
    return SimResult(schedule, CostModel(*means), ran.makespan, ran.ranks, [])


def test_the_prediction_times_each_model_stage_as_measured() -> None:
    from megatron_dualpipe.planner.measured_step import measured_stage_costs, predict

    measured = _measured(COSTS)
    assert measured_stage_costs(measured) == COSTS
    predicted = predict(measured)
    assert predicted.cost.stage_costs == COSTS
    # The same step back: the bubble of each rank is the measured one, rank 0 the long one.
    assert [r.bubble_ratio for r in predicted.ranks] == [r.bubble_ratio for r in measured.ranks]
    assert predicted.ranks[0].busy > predicted.ranks[1].busy
    # With the kinds' means every stage would cost the same, and rank 0 would not be long.
    uniform = simulate(measured.schedule, measured.cost)
    assert uniform.ranks[0].busy == uniform.ranks[1].busy


def test_the_footnote_names_the_placement_when_it_is_the_cause() -> None:
    from megatron_dualpipe.planner.measured_step import StepSummary, predict, summary_lines

    # Stage times 8, 3, 3 and 10 against their mean 6; rank 0 busy 18 x 4, rank 1 6 x 4.
    measured = _measured(COSTS)
    summary = StepSummary.of(10, measured, predict(measured), None)
    lines = summary_lines(summary)
    assert lines[-3:-1] == [
        "   (simulated: each model stage with its own measured mean times)",
        "   pipeline rank 0 is the long one because dualpipev places the embedding and the "
        "output layer and the loss there (stage 0 1.33x, stage 3 1.67x the mean model "
        "stage's time): placement, not the schedule; decoder_first/last_pipeline_num_layers "
        "can move layers off that rank",
    ]


def test_no_footnote_when_the_stages_cost_alike() -> None:
    from megatron_dualpipe.planner.measured_step import StepSummary, predict

    measured = _measured(((1.0, 1.0, 1.0),) * 4)
    assert StepSummary.of(10, measured, predict(measured), None).placement_note is None


def test_the_summary_puts_the_step_against_its_compute_bound() -> None:
    """The measured F, B and W compute (8 + 3 + 3 + 10 per micro-batch, 4 micro-batches)
    shared over the 2 ranks: 48; the step's ratio to it, measured and simulated."""
    from megatron_dualpipe.planner.measured_step import StepSummary, predict, summary_lines

    measured = _measured(COSTS)
    summary = StepSummary.of(10, measured, predict(measured), None)
    assert summary.bound_ms == 48.0
    ratio = measured.makespan / 48.0
    assert ratio > 1.3  # rank 0 holds 72 of the 96
    assert summary_lines(summary)[-1] == (
        " compute bound 48.0 ms (the measured F, B and W compute shared evenly over the "
        f"ranks): the measured step is {ratio:.3f}x it, the simulated {ratio:.3f}x"
    )
