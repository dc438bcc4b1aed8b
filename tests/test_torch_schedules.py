"""torch.distributed.pipelining's schedules import into our IR on the right placement and
pass our validator; parameters torch refuses are refused with one sentence."""

import pytest

pytest.importorskip("torch.distributed.pipelining.schedules")

from bench.peers import as_torch_runs  # noqa: E402
from megatron_dualpipe.planner.torch_schedules import (  # noqa: E402
    TORCH_SCHEDULES,
    import_torch_schedule,
)
from megatron_dualpipe.schedules import Kind, ScheduleError, generate, validate  # noqa: E402

PLACEMENTS = {
    "torch-1f1b": ("loop", 1),
    "torch-interleaved-1f1b": ("loop", 2),
    "torch-interleaved-zb": ("loop", 2),
    "torch-zbv": ("v", 2),
    "torch-dualpipev": ("v", 2),
}


def _counts(pp: int) -> list[int]:
    return [2 * pp, 3 * pp, 4 * pp]


@pytest.mark.parametrize("name", list(PLACEMENTS))
@pytest.mark.parametrize("pp", [2, *(pytest.param(pp, marks=pytest.mark.slow) for pp in (4, 8))])
def test_imported_schedules_validate(name: str, pp: int) -> None:
    kind, chunks = PLACEMENTS[name]
    for microbatches in _counts(pp):
        schedule = import_torch_schedule(name, pp, microbatches)
        p = schedule.placement
        assert (p.kind, p.num_chunks, p.num_ranks) == (kind, chunks, pp)
        validate(schedule)
        validate(as_torch_runs(schedule))
        kinds = {h.kind for acts in schedule.ranks for a in acts for h in a.computes}
        assert Kind.F in kinds and kinds & {Kind.B, Kind.BW}


def test_every_registered_schedule_is_covered() -> None:
    assert set(TORCH_SCHEDULES) == set(PLACEMENTS)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zbv_below_its_fill_and_interleaved_with_more_chunks_validate(pp: int) -> None:
    # ZBV pads to 2PP-1 micro-batches internally and drops the extra ones.
    validate(import_torch_schedule("torch-zbv", pp, pp))
    for chunks in (3, 4):
        schedule = import_torch_schedule("torch-interleaved-zb", pp, 2 * pp, chunks=chunks)
        assert schedule.placement.num_stages == chunks * pp
        validate(schedule)


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 2), (4, 5), (4, 16), (8, 17)])
def test_torch_1f1b_is_our_1f1b(pp: int, microbatches: int) -> None:
    # Also checks the relabelling of the last rank's forwards (torch's description of its
    # own 1F1B numbers them from 1 there).
    ours = generate("1f1b", pp, microbatches)
    assert import_torch_schedule("torch-1f1b", pp, microbatches).ranks == ours.ranks


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_torch_interleaved_1f1b_is_megatrons_order(pp: int) -> None:
    for microbatches in _counts(pp):
        ours = generate("interleaved-1f1b", pp, microbatches, chunks=2)
        theirs = import_torch_schedule("torch-interleaved-1f1b", pp, microbatches)
        assert theirs.ranks == ours.ranks


def test_as_torch_runs_moves_the_first_stages_dx_into_its_w() -> None:
    schedule = import_torch_schedule("torch-zbv", 4, 8)
    run = as_torch_runs(schedule)
    stage0 = [a for a in run.ranks[0] if a.stage == 0]
    assert not any(a.kind is Kind.B for a in stage0)
    assert sum(a.kind is Kind.BW for a in stage0) == 8
    assert run.ranks[1:] == schedule.ranks[1:]


@pytest.mark.parametrize(
    ("name", "pp", "microbatches", "chunks", "words"),
    [
        ("torch-interleaved-zb", 2, 9, None, "refuses PP=2 with 9 .* multiple of"),
        ("torch-interleaved-1f1b", 4, 17, None, "refuses PP=4 with 17 .* multiple of"),
        ("torch-dualpipev", 4, 7, None, "at least as many microbatches as stages"),
        ("torch-1f1b", 4, 3, None, "greater than or equal to the number of stages"),
        ("torch-zbv", 4, 8, 3, "exactly 2"),
        ("torch-nope", 4, 8, None, "unknown torch schedule"),
    ],
)
def test_refused_parameters_say_what_to_change(
    name: str, pp: int, microbatches: int, chunks: int | None, words: str
) -> None:
    with pytest.raises(ScheduleError, match=words):
        import_torch_schedule(name, pp, microbatches, chunks=chunks)
