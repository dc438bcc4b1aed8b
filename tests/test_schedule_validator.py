"""The validator accepts every generated schedule over the grid and rejects broken ones
with a message naming the rank, the action and what is unmet."""

import pytest

from megatron_dualpipe.schedules.ir import Action, Kind, Schedule, ScheduleError
from megatron_dualpipe.schedules.lowering import lower
from megatron_dualpipe.schedules.registry import SCHEDULES, generate, spec
from megatron_dualpipe.schedules.simulate import DeadlockError
from megatron_dualpipe.schedules.validate import validate


def _microbatch_counts(name: str, ranks: int, sampled: bool) -> list[int]:
    """Micro-batch counts to try at ``ranks``: all from one below the minimum up to
    ``4 x ranks``, or (``sampled``) the legality edges and a few counts in between."""
    low = max(1, spec(name).min_microbatches(ranks) - 1)
    counts = range(low, 4 * ranks + 1)
    if not sampled:
        return list(counts)
    picks = {low, low + 1, low + 2, 2 * ranks - 1, 2 * ranks, 2 * ranks + 1, 4 * ranks}
    return sorted(picks.intersection(counts))


def _check_every_configuration(name: str, sampled: bool) -> None:
    """Every PP from 2 to 16 (``sampled``: the small ones, odd and even, and a few large)."""
    checked = 0
    all_ranks = (2, 3, 4, 5, 6, 8, 12, 16) if sampled else range(2, 17)
    for ranks in all_ranks:
        for microbatches in _microbatch_counts(name, ranks, sampled):
            if not spec(name).is_legal(ranks, microbatches):
                with pytest.raises(ScheduleError, match=name):
                    generate(name, ranks, microbatches)
                continue
            lowered = validate(generate(name, ranks, microbatches))
            assert lowered.is_lowered
            checked += 1
    assert checked >= len(all_ranks)  # legal configurations were run, not only refusals


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_legal_configurations_validate_sampled(name: str) -> None:
    _check_every_configuration(name, sampled=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_legal_configuration_validates(name: str) -> None:
    _check_every_configuration(name, sampled=False)


def _edit(schedule: Schedule, rank: int, edit) -> Schedule:
    ranks = [list(acts) for acts in schedule.ranks]
    ranks[rank] = edit(ranks[rank])
    return Schedule(schedule.name, schedule.placement, ranks)


def test_rejects_missing_w() -> None:
    schedule = generate("zb1p", 4, 8)
    broken = _edit(schedule, 2, lambda acts: [a for a in acts if str(a) != "2W5"])
    with pytest.raises(ScheduleError, match=r"rank 2: 2B5 has no matching 2W5"):
        validate(broken)


def test_rejects_w_before_its_b() -> None:
    def swap(acts):
        i, j = acts.index(Action(Kind.B, 1, 3)), acts.index(Action(Kind.W, 1, 3))
        acts[i], acts[j] = acts[j], acts[i]
        return acts

    with pytest.raises(ScheduleError, match=r"rank 1: 1W3 runs before its input-gradient pass"):
        validate(_edit(generate("zb1p", 4, 8), 1, swap))


def test_rejects_swapped_local_stage_dependency() -> None:
    # At the bottom of the V rank R-1 runs stage R-1 then stage R for each micro-batch.
    schedule = generate("dualpipev", 4, 8)

    def swap(acts):
        first = next(i for i, a in enumerate(acts) if a == Action(Kind.F, 3, 0, 0))
        second = next(i for i, a in enumerate(acts) if a == Action(Kind.F, 4, 0, 1))
        acts[first], acts[second] = acts[second], acts[first]
        return acts

    with pytest.raises(ScheduleError, match=r"rank 3: 4F0 runs before the forward of the previous"):
        validate(_edit(schedule, 3, swap))


def test_rejects_unmatched_send() -> None:
    lowered = lower(generate("1f1b", 4, 8))
    broken = _edit(lowered, 2, lambda acts: [a for a in acts if str(a) != "2RECV_F5"])
    with pytest.raises(ScheduleError, match=r"rank 2: 2RECV_F5 is missing"):
        validate(broken)


def test_rejects_receive_after_its_consumer() -> None:
    lowered = lower(generate("1f1b", 4, 8))

    def move(acts):
        recv = acts.pop(acts.index(Action(Kind.RECV_F, 1, 2)))
        acts.insert(acts.index(Action(Kind.F, 1, 2)) + 1, recv)
        return acts

    with pytest.raises(ScheduleError, match=r"rank 1: 1F2 runs before its receive 1RECV_F2"):
        validate(_edit(lowered, 1, move))


def test_rejects_channel_order_mismatch() -> None:
    lowered = lower(generate("1f1b", 4, 8))

    def receive_6_first(acts):
        recv6 = acts.pop(acts.index(Action(Kind.RECV_F, 1, 6)))
        acts.insert(acts.index(Action(Kind.RECV_F, 1, 5)), recv6)
        return acts

    with pytest.raises(ScheduleError, match=r"rank 0 -> rank 1 \(F\): message 5 is sent for 1"):
        validate(_edit(lowered, 1, receive_6_first))


def test_rejects_deadlock_naming_waiting_ranks() -> None:
    # Rank 0 backs up micro-batch 0 before forwarding 1..3, but rank 1 forwards all four
    # micro-batches before its first backward: each waits for the other.
    placement = generate("1f1b", 2, 4).placement
    ranks = [
        [Action(Kind.F, 0, 0), Action(Kind.BW, 0, 0)]
        + [Action(Kind.F, 0, m) for m in range(1, 4)]
        + [Action(Kind.BW, 0, m) for m in range(1, 4)],
        [Action(Kind.F, 1, m) for m in range(4)] + [Action(Kind.BW, 1, m) for m in range(4)],
    ]
    expected = r"rank 0 waits at 0BW0 for 0RECV_B0 from rank 1; rank 1 waits at 1F1 for 1RECV_F1"
    with pytest.raises(DeadlockError, match=expected):
        validate(Schedule("hand", placement, ranks))


def test_rejects_action_on_the_wrong_rank() -> None:
    schedule = generate("1f1b", 2, 2)
    broken = _edit(schedule, 0, lambda acts: [*acts, Action(Kind.F, 1, 0)])
    with pytest.raises(ScheduleError, match=r"rank 0: 1F0 runs stage 1, which lives on rank 1"):
        validate(broken)
