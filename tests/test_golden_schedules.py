"""Every registered schedule's compute order and communication plan equal the checked-in
grids of tests/golden/schedules/ (``python -m tests.golden_schedules`` writes them again
after a deliberate change), and the grids hold every legal cell and nothing else."""

from __future__ import annotations

import pytest

from megatron_dualpipe.schedules.ir import Schedule
from megatron_dualpipe.schedules.registry import SCHEDULES, spec
from tests.golden_schedules import FOLDER, GRID, file_name, rendered


@pytest.mark.parametrize("cell", GRID, ids=lambda cell: file_name(*cell)[: -len(".txt")])
def test_the_order_and_the_plan_are_the_checked_in_ones(cell: tuple[str, int, int]) -> None:
    golden = (FOLDER / file_name(*cell)).read_text(encoding="utf-8")
    assert rendered(*cell) == golden, (
        f"{file_name(*cell)} differs from what the generators make now: if the change is "
        "meant, run python -m tests.golden_schedules and review the diff"
    )


def test_the_grids_cover_every_schedule_and_only_legal_cells() -> None:
    assert {name for name, _, _ in GRID} == set(SCHEDULES)
    for name, pp, microbatches in GRID:
        assert spec(name).problem(pp, microbatches) is None, (name, pp, microbatches)
    assert sorted(p.name for p in FOLDER.glob("*.txt")) == sorted(file_name(*c) for c in GRID)


def test_a_grid_reads_back_as_the_schedule_it_shows() -> None:
    """The compute order's part of a golden file is the schedule's own text form."""
    text = (FOLDER / file_name("dualpipev", 4, 9)).read_text(encoding="utf-8")
    order = text.split("\n\n", 1)[0] + "\n"
    schedule = Schedule.from_text(order)
    assert schedule.name == "dualpipev" and schedule.num_microbatches == 9
    assert schedule.to_text() == order
