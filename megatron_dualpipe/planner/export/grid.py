"""Text timeline of a simulated (or measured) step: one row per rank, time flowing right."""

from __future__ import annotations

import math

from ...schedules.ir import Action, Kind
from ...schedules.simulate import SimResult

__all__ = ["to_grid"]

IDLE = "."
FILL = "-"
_MARK = {Kind.F: "", Kind.B: "b", Kind.W: "w", Kind.BW: "B"}


def _label(action: Action) -> str:
    """``3`` forward, ``b3`` dX, ``w3`` dW, ``B3`` full backward, ``F3b1`` / ``F3B1`` FB."""
    if action.kind is Kind.FB:
        forward, backward = action.sub
        return f"F{forward.microbatch}{_label(backward)}"
    return f"{_MARK[action.kind]}{action.microbatch}"


def to_grid(result: SimResult, width: int | None = None) -> str:
    """Draw ``result`` as text: a header, one row per rank and a legend line.

    A cell is one time quantum, the shortest action's duration, drawn ``d + 1`` characters
    wide (``d``: digits of the largest micro-batch). ``width`` caps the timeline at that many
    characters by coarsening the quantum; actions then keep at least one cell, and a later
    action that lands on the same cell overwrites the earlier one.
    """
    timed = [t for rank in result.ranks for t in rank.actions]
    digits = len(str(max((t.action.microbatch for t in timed), default=0)))
    cell = digits + 1
    end = max((t.end for t in timed), default=0.0)
    durations = [t.end - t.start for t in timed if t.end > t.start]
    quantum = min(durations, default=1.0)
    if width is not None and end / quantum * cell > width:
        quantum = end / max(width // cell, 1)
    slots = max(1, math.ceil(end / quantum - 1e-9))

    def slot(t: float) -> int:
        return math.floor(t / quantum + 0.5)

    rows = []
    label_width = len(str(len(result.ranks) - 1))
    for index, rank in enumerate(result.ranks):
        line = [IDLE] * (slots * cell)
        for t in rank.actions:
            first = min(slot(t.start), slots - 1)
            span = (min(max(slot(t.end), first + 1), slots) - first) * cell
            text = _label(t.action).rjust(cell) + FILL * span
            line[first * cell : first * cell + span] = text[:span]
        rows.append(f"rank {index:>{label_width}} |{''.join(line)}|")
    header = (
        f"{result.schedule.name}: {len(result.ranks)} ranks, makespan {end:g}, "
        f"1 cell = {quantum:.3g} time units"
    )
    legend = (
        f"legend: N forward of micro-batch N, bN backward dX, wN weight grad dW, "
        f"BN full backward, FNbM / FNBM forward of N overlapped with backward of M, "
        f"{FILL} continues, {IDLE} idle"
    )
    return "\n".join([header, *rows, legend]) + "\n"
