"""The step against its compute bound (pure Python).

- The bound is the compute shared evenly over the ranks: by hand on dualpipev, and one
  figure for every registered schedule of a model (no schedule changes it).
- Every rank's step beyond the bound splits exactly into exposed all-to-all, idle time,
  imbalance and hidden time, on uneven stages with all-to-all shares and overlapped pairs.
- A lone pass exposes its whole all-to-all share; a pair hides what its overlap says, and
  nothing is hidden below compute unless the overlap claims it.
- The split's bound is the busiest rank's compute: the even bound on equal stages, above
  it on uneven ones, and no schedule's step under it.
- Costs: the shares are read from ``--cost`` text and refused out of range.
"""

from __future__ import annotations

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.planner.bound import step_bound
from megatron_dualpipe.schedules.cost import CostModel
from megatron_dualpipe.schedules.ir import Action, Kind, ScheduleError
from megatron_dualpipe.schedules.registry import SCHEDULES, generate
from megatron_dualpipe.schedules.simulate import simulate


def test_the_bound_of_dualpipev_by_hand() -> None:
    """8 stages of F=1, B=1, W=0.5 with half of F and B all-to-all: 1.5 of compute per
    stage and micro-batch, two stages a rank, 8 micro-batches: 24 per rank."""
    cost = CostModel(f=1.0, b=1.0, w=0.5, a2a_f=0.5, a2a_b=0.5, overlap=0.6)
    bound = step_bound(simulate(generate("dualpipev", 4, 8), cost))
    assert bound.bound == 24.0
    assert [r.compute for r in bound.ranks] == [24.0] * 4
    assert bound.ratio == bound.step / 24.0 and bound.efficiency == 24.0 / bound.step
    assert bound.split_bound == 24.0 and bound.split_ratio == bound.ratio


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_splits_bound_is_the_busiest_ranks_compute_and_no_step_beats_it(name: str) -> None:
    """The first and last stages heavier (the embedding's, the head's and the loss's):
    the busiest rank computes more than the even share, and the step, whatever the
    schedule overlaps, is no shorter than that rank's compute."""
    schedule = generate(name, 4, 12)
    n = schedule.placement.num_model_stages
    stages = tuple((1.0 + 2.0 * (s in (0, n - 1)), 1.5, 0.7) for s in range(n))
    cost = CostModel(stage_costs=stages, overlap=0.53, a2a_f=0.63, a2a_b=0.48)
    bound = step_bound(simulate(schedule, cost))
    busiest = max(r.compute for r in bound.ranks)
    assert bound.split_bound == busiest > bound.bound
    assert bound.step >= busiest and bound.split_ratio == bound.step / busiest
    assert bound.to_json()["split_bound"] == busiest


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_ranks_compute_by_hand_on_uneven_stages_and_ranks(name: str) -> None:
    """A rank's compute is, over the stages it holds and the micro-batches passing each,
    F and B without their all-to-all share and W whole, times the rank's scale: however
    the schedule pairs them (FB with a full backward, BW, split B and W)."""
    schedule = generate(name, 4, 12)
    p = schedule.placement
    n = p.num_model_stages
    stages = tuple((1.0 + 0.5 * s, 2.0 + 0.25 * s, 0.5 + 0.1 * s) for s in range(n))
    rank_scale = (1.0, 1.5, 0.75, 2.0)
    cost = CostModel(
        stage_costs=stages, rank_scale=rank_scale, overlap=0.6, a2a_f=0.6, a2a_b=0.3
    )
    bound = step_bound(simulate(schedule, cost))
    for rank in range(p.num_ranks):
        expected = 0.0
        for chunk in range(p.num_chunks):
            stage = p.stage_of(rank, chunk)
            passing = sum(stage in p.path(m) for m in range(p.num_microbatches))
            f, b, w = stages[p.model_stage(stage)]
            expected += passing * (f * 0.4 + b * 0.7 + w) * rank_scale[rank]
        assert bound.ranks[rank].compute == pytest.approx(expected), (name, rank)
    assert bound.bound == pytest.approx(sum(r.compute for r in bound.ranks) / p.num_ranks)


def test_no_schedule_changes_the_bound() -> None:
    """One rank's share of the model costs the same under every schedule (each schedule's
    stages get their part of it): one bound for all."""
    share = CostModel(f=3.0, b=4.0, w=2.0, a2a_f=0.4, a2a_b=0.25)
    bounds = {}
    for name in SCHEDULES:
        schedule = generate(name, 4, 8)
        p = schedule.placement
        cost = share.per_stage(p.num_ranks, p.num_model_stages)
        bounds[name] = step_bound(simulate(schedule, cost)).bound
    expected = 8 * (3.0 * 0.6 + 4.0 * 0.75 + 2.0)
    assert bounds == pytest.approx(dict.fromkeys(SCHEDULES, expected))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("overlap", [0.53, 0.2, 1.0])
def test_every_ranks_step_splits_into_its_parts(name: str, overlap: float) -> None:
    """step - bound = exposed + idle + imbalance - hidden on every rank, on stages of
    uneven costs (the first and last heavier, as the embedding's and the head's)."""
    schedule = generate(name, 4, 12)
    n = schedule.placement.num_model_stages
    stages = tuple((1.0 + (s in (0, n - 1)), 1.5 + 0.1 * s, 0.7) for s in range(n))
    cost = CostModel(stage_costs=stages, overlap=overlap, a2a_f=0.63, a2a_b=0.48)
    bound = step_bound(simulate(schedule, cost))
    for r in bound.ranks:
        parts = r.exposed + r.idle + r.imbalance - r.hidden
        assert parts == pytest.approx(bound.step - bound.bound), (name, r)
    assert sum(r.imbalance for r in bound.ranks) == pytest.approx(0.0, abs=1e-9)
    assert any(r.imbalance > 0 for r in bound.ranks)


def test_a_lone_pass_exposes_its_all_to_all_and_a_pair_hides_what_its_overlap_says() -> None:
    """1F1B at PP=2 runs no pair: each rank waits for its passes' whole all-to-all share.
    dualpipev pairs its passes: with DeepSeek's overlap (the pair longer than its compute)
    nothing is hidden below compute; with an overlap below the compute share, the pair's
    time under its compute is counted as hidden."""
    cost = CostModel(f=2.0, b=4.0, w=1.0, a2a_f=0.5, a2a_b=0.25)
    lone = step_bound(simulate(generate("1f1b", 2, 4), cost))
    assert [r.exposed for r in lone.ranks] == [4 * (1.0 + 1.0)] * 2
    assert all(r.hidden == 0 for r in lone.ranks)
    # A pair takes 0.75 x (F + B) = 4.5 against 4 of compute, or with its W (a full
    # backward) 0.75 x 7 = 5.25 against 5.
    deepseek = CostModel(f=2.0, b=4.0, w=1.0, a2a_f=0.5, a2a_b=0.25, overlap=0.75)
    paired = step_bound(simulate(generate("dualpipev", 4, 16), deepseek))
    assert all(r.hidden == 0 for r in paired.ranks)
    claims = CostModel(f=2.0, b=4.0, w=1.0, a2a_f=0.5, a2a_b=0.25, overlap=0.5)
    hidden = step_bound(simulate(generate("dualpipev", 4, 16), claims))
    # A pair of F=2 and B=4 takes 0.5 x 6 = 3, below its compute 1 + 3 = 4.
    assert all(r.hidden > 0 for r in hidden.ranks)
    assert all(r.exposed < p.exposed for r, p in zip(hidden.ranks, paired.ranks, strict=True))


def test_shares_are_read_from_cost_text_and_refused_out_of_range() -> None:
    cost = CostModel.parse("F=24.3,B=27.9,W=8.8,overlap=0.53,a2a_f=0.63,A2A_B=0.48")
    assert (cost.a2a_f, cost.a2a_b) == (0.63, 0.48)
    with pytest.raises(ScheduleError) as raised:
        CostModel.parse("F=1,a2a_f=1.5")
    assert str(raised.value) == (
        "cost a2a_f is a share of the pass's time: a number from 0 to 1, got 1.5"
    )


def test_simulate_prints_the_bound_and_each_ranks_split(capsys) -> None:
    """One rank's share F=2, B=2, W=1, half of F and B all-to-all: 3 of compute per
    micro-batch, 24 over 8; the rank table's figures add up to the step."""
    argv = ["simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "8"]
    assert main([*argv, "--cost", "F=2,B=2,W=1,a2a_f=0.5,a2a_b=0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("compute bound 24.00: the step is ")
    ratio = float(lines[1].split("the step is ")[1].split("x")[0])
    assert lines[1].endswith(
        f"the split's bound (its busiest rank's compute) 24.00: the step is {ratio:.3f}x it"
    )
    header = lines[2].split()
    assert header[:6] == ["rank", "busy", "compute", "exposed", "a2a", "idle"]
    step = float(lines[0].split("makespan=")[1].split()[0])
    for row in lines[4:8]:
        busy, compute, exposed, idle = map(float, row.split()[1:5])
        assert compute == 24.0 and busy == pytest.approx(compute + exposed)
        assert busy + idle == pytest.approx(step)


def test_per_stage_all_to_all_costs_a_lone_pass_both_and_a_pair_the_busier_stream() -> None:
    """Two stages: a MoE one (F compute 9, all-to-all 15; dX 14.6 and 13.3; W 8.8, the
    profiled layer's rounded) and a dense one that exchanges nothing. A lone pass waits for
    its all-to-all; a pair lasts as long as the busier of its compute streams and its
    communication stream; the compute bound counts compute only."""
    cost = CostModel(
        stage_costs=((9.0, 14.6, 8.8), (9.0, 14.6, 8.8)), stage_a2a=((15.0, 13.3), (0.0, 0.0))
    )

    def same(stage: int) -> int:  # each stage its own model stage
        return stage

    forward, backward = Action(Kind.F, 0, 0), Action(Kind.BW, 0, 0)
    assert cost.duration(forward, 0, same) == pytest.approx(24.0)
    assert cost.duration(backward, 0, same) == pytest.approx(14.6 + 8.8 + 13.3)
    assert cost.compute(forward, 0, same) == 9.0
    pair = Action.overlapped(forward, backward)
    assert cost.duration(pair, 0, same) == pytest.approx(max(9 + 14.6 + 8.8, 15 + 13.3))
    # Compute the busier: a MoE forward beside a dense stage's full backward; all-to-all
    # the busier: small compute, long exchanges.
    beside_dense = Action.overlapped(forward, Action(Kind.BW, 1, 0))
    assert cost.duration(beside_dense, 0, same) == pytest.approx(9 + 14.6 + 8.8)
    heavy = CostModel(stage_costs=((1.0, 1.0, 0.5),), stage_a2a=((3.0, 2.0),))
    one = Action.overlapped(Action(Kind.F, 0, 0), Action(Kind.B, 0, 1))
    assert heavy.duration(one, 0, same) == 5.0
    # A dense stage's lone pass waits for nothing; a slow rank computes slower, its
    # all-to-all is the same.
    assert cost.duration(Action(Kind.F, 1, 0), 0, same) == 9.0
    slow = CostModel(stage_costs=cost.stage_costs, stage_a2a=cost.stage_a2a, rank_scale=(2.0,))
    assert slow.duration(forward, 0, same) == pytest.approx(2 * 9.0 + 15.0)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"stage_a2a": ((1.0, 1.0),)}, "need per-stage compute costs"),
        ({"stage_costs": ((1, 1, 1),), "stage_a2a": ((1.0, 1.0), (1.0, 1.0))}, "same length"),
        ({"stage_costs": ((1, 1, 1),), "stage_a2a": ((1.0, 1.0),), "a2a_f": 0.5}, "shares"),
        ({"stage_costs": ((1, 1, 1),), "stage_a2a": ((1.0, 1.0),), "overlap": 0.5}, "overlap"),
        ({"stage_costs": ((1, 1, 1),), "stage_a2a": ((1.0, -1.0),)}, "two times"),
    ],
)
def test_per_stage_all_to_all_that_cannot_be_used_is_one_sentence(fields, said) -> None:
    with pytest.raises(ScheduleError, match=said) as raised:
        CostModel(**fields)
    assert "\n" not in str(raised.value)
