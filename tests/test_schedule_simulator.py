"""The simulator reproduces the published closed-form bubbles and keeps live activations
within each schedule's stated bound.

Bubble here is a rank's idle time within the step (makespan minus its compute). Costs are
per stage: F forward, B input gradient (dX), W weight gradient (dW); the tables' "full
backward" is B + W. Activations count one stage's saved activations of one micro-batch.
"""

import pytest

from megatron_dualpipe.schedules.cost import CostModel
from megatron_dualpipe.schedules.ir import ScheduleError
from megatron_dualpipe.schedules.lowering import lower
from megatron_dualpipe.schedules.registry import SCHEDULES, generate, spec
from megatron_dualpipe.schedules.simulate import simulate

COSTS = [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5), (1.5, 1.2, 0.7), (1, 1, 0)]


def _idle(name: str, ranks: int, microbatches: int, cost: CostModel) -> list[float]:
    return [r.idle for r in simulate(generate(name, ranks, microbatches), cost).ranks]


@pytest.mark.parametrize(("f", "b", "w"), COSTS)
@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_1f1b_bubble_is_closed_form(f: float, b: float, w: float, ranks: int) -> None:
    for microbatches in (ranks, 2 * ranks + 1):
        idle = _idle("1f1b", ranks, microbatches, CostModel(f=f, b=b, w=w))
        assert idle == pytest.approx([(ranks - 1) * (f + b + w)] * ranks)


@pytest.mark.parametrize(("f", "b", "w"), [c for c in COSTS if c[2] <= min(c[0], c[1])])
@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_zb1p_bubble_is_closed_form(f: float, b: float, w: float, ranks: int) -> None:
    # (PP-1)(F + B_full - 2W) with B_full = B + W; holds where W <= F and W <= B.
    for microbatches in (ranks, 3 * ranks):
        idle = _idle("zb1p", ranks, microbatches, CostModel(f=f, b=b, w=w))
        assert idle == pytest.approx([(ranks - 1) * (f + b - w)] * ranks)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
@pytest.mark.parametrize("ranks", [2, 4, 6, 8])
@pytest.mark.parametrize("fb", [3.0, 2.5, 2.0])
def test_dualpipe_bubble_is_closed_form(name: str, ranks: int, fb: float) -> None:
    """(n-1)(F&B + B_full - 3W), n = ranks on one direction's walk (PP/2 for DualPipe's PP
    ranks; PP/2 = ranks for DualPipeV's 2*ranks stages), at F = B = W = 1. With F&B equal to
    F plus the full backward every rank idles exactly that long; with F&B shorter (down to
    F + B), the most idle rank does."""
    n = ranks // 2 if name == "dualpipe" else ranks
    closed_form = (n - 1) * (fb + 2 - 3)
    lo = spec(name).min_microbatches(ranks)
    for microbatches in (lo, lo + 2, 2 * lo):
        idle = _idle(name, ranks, microbatches, CostModel(f=1, b=1, w=1, fb=fb))
        assert max(idle) == pytest.approx(closed_form)
        if fb == 3.0:
            assert idle == pytest.approx([closed_form] * ranks)


def test_overlap_shortens_dualpipe_step() -> None:
    schedule = generate("dualpipev", 4, 16)
    plain = simulate(schedule, CostModel(fb=3.0)).makespan
    overlapped = simulate(schedule, CostModel(overlap=0.7)).makespan
    assert overlapped < plain


def _published_bound(name: str, ranks: int, microbatches: int) -> list[int]:
    """Bounds from the anchors table: 1F1B rank r: PP - r; ZB1P: PP; DualPipe: PP + 1;
    DualPipeV: 2*PP + 1 stages (its table's PP counts stages). Interleaved (2 chunks):
    Megatron's warm-up + 1, or everything when micro-batches == PP (no steady phase)."""
    if name == "interleaved-1f1b":
        if microbatches == ranks:
            return [2 * microbatches] * ranks
        return [min(2 * (ranks - r - 1) + ranks + 1, 2 * microbatches) for r in range(ranks)]
    bound = {
        "1f1b": [ranks - r for r in range(ranks)],
        "zb1p": [ranks] * ranks,
        "dualpipe": [ranks + 1] * ranks,
        "dualpipev": [2 * ranks + 1] * ranks,
    }[name]
    return [min(b, microbatches) if name in ("1f1b", "zb1p") else b for b in bound]


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_peak_activations_within_published_bound(name: str, ranks: int) -> None:
    """Peaks never exceed the bound, the generator states the same bound, and every rank
    reaches it (the bound is tight)."""
    lo = spec(name).min_microbatches(ranks)
    for microbatches in sorted({lo, lo + 2 * ranks, 4 * ranks}):
        try:
            schedule = generate(name, ranks, microbatches)
        except ScheduleError:
            continue
        published = _published_bound(name, ranks, microbatches)
        peaks = [r.peak_activations for r in simulate(schedule).ranks]
        assert schedule.activation_bound == published
        assert peaks == published


def test_latency_adds_to_the_critical_path() -> None:
    # One micro-batch crosses 2(PP-1) hops: down with its forward, up with its backward.
    for microbatches, exact in ((1, True), (8, False)):
        schedule = generate("1f1b", 4, microbatches)
        base = simulate(schedule, CostModel()).makespan
        delayed = simulate(schedule, CostModel(latency=0.25)).makespan
        assert delayed >= base + 6 * 0.25
        assert (delayed == pytest.approx(base + 6 * 0.25)) is exact


def test_lowered_and_compute_only_give_the_same_timeline() -> None:
    schedule = generate("dualpipe", 4, 12)
    cost = CostModel(f=1, b=1.3, w=0.6, overlap=0.8, latency=0.1)
    a, b = simulate(schedule, cost), simulate(lower(schedule), cost)
    assert a.makespan == b.makespan
    assert [r.actions for r in a.ranks] == [r.actions for r in b.ranks]
    assert sorted(a.messages) == sorted(b.messages)


def test_uneven_stages_slow_the_step() -> None:
    schedule = generate("1f1b", 4, 8)
    even = simulate(schedule, CostModel()).makespan
    uneven = simulate(schedule, CostModel(stage_scale=(1, 1, 1, 2))).makespan
    assert uneven > even
    with pytest.raises(ScheduleError, match="stage_scale has 3 entries but the model has 4"):
        simulate(schedule, CostModel(stage_scale=(1, 1, 1)))


@pytest.mark.parametrize("name", ["1f1b", "zb1p", "dualpipe", "dualpipev"])
def test_per_stage_costs_time_each_stage_by_its_own_f_b_w(name: str) -> None:
    schedule = generate(name, 4, 8)
    stages = schedule.placement.num_model_stages
    scaled = CostModel(f=1, b=1.5, w=0.5, stage_scale=tuple(1 + s / 4 for s in range(stages)))
    per_stage = CostModel(
        stage_costs=tuple((1 + s / 4, 1.5 * (1 + s / 4), 0.5 * (1 + s / 4)) for s in range(stages))
    )
    assert simulate(schedule, per_stage).makespan == simulate(schedule, scaled).makespan
    # A stage whose B alone is heavy: every rank holding it is busy at least M x its work.
    heavy = tuple((1.0, 9.0 if s == 1 else 1.0, 1.0) for s in range(stages))
    result = simulate(schedule, CostModel(stage_costs=heavy))
    passes = sum(1 in schedule.placement.path(m) for m in range(8))
    assert result.makespan >= passes * (1 + 9 + 1)
    with pytest.raises(
        ScheduleError, match=f"stage_costs has 2 entries but the model has {stages}"
    ):
        simulate(schedule, CostModel(stage_costs=((1, 1, 1),) * 2))
    with pytest.raises(ScheduleError, match="cannot be combined with FB"):
        CostModel(fb=2.0, stage_costs=heavy)
