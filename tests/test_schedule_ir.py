"""The IR's text and JSON forms round-trip, and bad text is refused with a clear message."""

import json

import pytest

from megatron_dualpipe.schedules.ir import Action, Kind, Placement, Schedule, ScheduleError
from megatron_dualpipe.schedules.lowering import lower
from megatron_dualpipe.schedules.registry import SCHEDULES, generate, spec


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("lowered", [False, True])
def test_text_and_json_round_trip(name: str, lowered: bool) -> None:
    schedule = generate(name, 4, 2 * spec(name).min_microbatches(4))
    if lowered:
        schedule = lower(schedule)
    from_text = Schedule.from_text(schedule.to_text())
    assert from_text.ranks == schedule.ranks
    assert from_text.placement == schedule.placement
    from_json = Schedule.from_json(json.loads(json.dumps(schedule.to_json())))
    assert from_json.ranks == schedule.ranks
    assert from_json.activation_bound == schedule.activation_bound


def test_tokens_read_as_written() -> None:
    placement = Placement("v", 4, 8, 10)
    text = (
        "name=hand placement=v ranks=4 stages=8 microbatches=10\n"
        "0: 0F4 (0F4;7B1)FB 7W1 7BW2\n1: 1SEND_F3\n2:\n3: 3RECV_B0\n"
    )
    schedule = Schedule.from_text(text)
    fb = schedule.ranks[0][1]
    assert fb.kind is Kind.FB
    assert fb.sub == (Action(Kind.F, 0, 4, 0), Action(Kind.B, 7, 1, 1))
    assert schedule.ranks[0][3] == Action(Kind.BW, 7, 2, placement.chunk_of(7))
    assert schedule.ranks[1][0].kind is Kind.SEND_F
    assert " ".join(map(str, schedule.ranks[0])) == "0F4 (0F4;7B1)FB 7W1 7BW2"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0: 0F0\n", "header"),
        ("name=x placement=loop ranks=2 stages=2 microbatches=1\n0: 0X0\n1:\n", "cannot read"),
        ("name=x placement=loop ranks=2 stages=2 microbatches=1\n0: 0F0\n", "each rank 0..1"),
        ("name=x placement=loop ranks=2 stages=2 microbatches=1\n0: 5F0\n1:\n", "out of range"),
        ("name=x placement=zigzag ranks=2 stages=2 microbatches=1\n0:\n1:\n", "unknown placement"),
        ("name=x placement=mirror ranks=2 stages=4 microbatches=3\n0:\n1:\n", "even number"),
    ],
)
def test_bad_text_names_the_problem(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_text(text)


@pytest.mark.parametrize("kind", ["loop", "v", "mirror"])
def test_placement_maps_stages_to_ranks_and_back(kind: str) -> None:
    p = Placement(kind, 4, 8, 8)
    for stage in range(8):
        assert p.stage_of(p.rank_of(stage), p.chunk_of(stage)) == stage
    for mb in range(8):
        path = list(p.path(mb))
        assert p.prev_stage(path[0]) is None and p.next_stage(path[-1]) is None
        assert all(p.next_stage(a) == b for a, b in zip(path, path[1:], strict=False))


def test_mirror_directions_enter_at_opposite_ends() -> None:
    p = Placement("mirror", 4, 8, 8)
    assert [p.rank_of(s) for s in p.path(0)] == [0, 1, 2, 3]
    assert [p.rank_of(s) for s in p.path(7)] == [3, 2, 1, 0]
    assert [p.model_stage(s) for s in p.path(7)] == [0, 1, 2, 3]
    assert p.param_factor == 2.0


def test_weight_grads_relabelled_into_b_order_and_out_of_order_ones_refused() -> None:
    from megatron_dualpipe.schedules import CostModel, simulate
    from megatron_dualpipe.schedules.validate import check_weight_grads_in_b_order, validate

    ordered = generate("zb1p", 2, 4)  # rank 0: ... 0B2 0W2 0B3 0W3
    late = [a for a in ordered.ranks[0] if str(a) != "0W2"] + [Action(Kind.W, 0, 2)]
    swapped = Schedule("swapped", ordered.placement, [late, ordered.ranks[1]])
    assert " ".join(map(str, late[-4:])) == "0B2 0B3 0W3 0W2"
    validate(swapped)  # dependencies alone allow it ...
    with pytest.raises(ScheduleError, match=r"^rank 0: 0W3 runs where the weight gradient of 0W2"):
        check_weight_grads_in_b_order(swapped)  # ... a first-in first-out store does not
    relabelled = swapped.with_weight_grads_in_b_order()
    assert " ".join(map(str, relabelled.ranks[0][-4:])) == "0B2 0B3 0W2 0W3"
    check_weight_grads_in_b_order(relabelled)
    cost = CostModel(1.0, 1.0, 0.5)
    assert simulate(swapped, cost).makespan == simulate(relabelled, cost).makespan
