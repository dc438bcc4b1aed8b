"""The checked-in schedule grids: each registered schedule's compute order and the
communication plan the executor runs for it, at a few pipeline sizes and micro-batch
counts, in ``tests/golden/schedules/`` (one file per schedule and size).

``python -m tests.golden_schedules`` writes them again from the generators;
``test_golden_schedules.py`` holds the generators to them, so that any change to an
order or a plan shows in review as a diff of these files. A plan is rendered one step a
line: ``compute ACTION``, ``issue OP OP ...`` (``send KEY>PEER`` or ``recv KEY<PEER``, all on
the pipeline's communicator), ``wait KEY ...``, ``init COMM``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_dualpipe.schedules.comm_plan import (
    Compute,
    Init,
    Issue,
    Step,
    Wait,
    comm_plan,
    key_text,
)
from megatron_dualpipe.schedules.registry import generate

FOLDER = Path(__file__).resolve().parent / "golden" / "schedules"

#: (schedule, pipeline size, micro-batches): every registered schedule at PP=2 and 4, with
#: micro-batch counts at and above each one's least (and an odd one where it is legal).
GRID = (
    *((name, 2, 4) for name in ("1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev")),
    *((name, 4, 8) for name in ("1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev")),
    ("1f1b", 4, 5),
    ("zb1p", 4, 5),
    ("dualpipe", 4, 10),
    ("dualpipev", 4, 9),
)


def file_name(name: str, pp: int, microbatches: int) -> str:
    return f"{name}-pp{pp}-mb{microbatches}.txt"


def _step_text(step: Step) -> str:
    if isinstance(step, Compute):
        return f"compute {step.action}"
    if isinstance(step, Issue):
        ops = (
            f"send {key_text(op.key)}>{op.peer}" if op.kind == "send"
            else f"recv {key_text(op.key)}<{op.peer}"
            for op in step.ops
        )  # fmt: skip
        return "issue " + " ".join(ops)
    if isinstance(step, Wait):
        return "wait " + " ".join(map(key_text, step.keys))
    if isinstance(step, Init):
        return f"init {step.comm}"
    raise TypeError(f"no text for plan step {step!r}")


def rendered(name: str, pp: int, microbatches: int) -> str:
    """The golden file's text: the compute order, then each rank's plan."""
    schedule = generate(name, pp, microbatches)
    plan = comm_plan(schedule)
    lines = [schedule.to_text().rstrip("\n")]
    for rank, steps in enumerate(plan.ranks):
        lines += ["", f"# rank {rank}'s communication plan"]
        lines += [_step_text(step) for step in steps]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Write every file of :data:`GRID` and remove any other."""
    FOLDER.mkdir(parents=True, exist_ok=True)
    wanted = {file_name(*cell): cell for cell in GRID}
    for stale in FOLDER.glob("*.txt"):
        if stale.name not in wanted:
            stale.unlink()
    for name, cell in wanted.items():
        (FOLDER / name).write_text(rendered(*cell), encoding="utf-8")
    print(f"wrote {len(wanted)} schedule grids to {FOLDER}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
