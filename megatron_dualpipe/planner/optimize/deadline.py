"""The optimiser's clock inside its steps: a deadline the list scheduler, the timing and
the local search check as they go, so that the time limit holds within a step too, not
only between steps."""

from __future__ import annotations

import time

__all__ = ["Deadline", "OutOfTime"]

#: Checks between two readings of the clock (a check is one scheduling event or one rank's
#: turn in a timing: microseconds each).
_EVERY = 256


class OutOfTime(Exception):
    """The deadline passed inside a step; the step's work so far is dropped."""


class Deadline:
    """A ``time.perf_counter`` value (None: no limit) that :meth:`check` enforces."""

    def __init__(self, at: float | None) -> None:
        self.at = at
        self._calls = 0

    def passed(self) -> bool:
        return self.at is not None and time.perf_counter() >= self.at

    def check(self) -> None:
        """Raise :class:`OutOfTime` once the deadline has passed (the clock is read every
        few hundred calls)."""
        self._calls += 1
        if self._calls % _EVERY == 0 and self.passed():
            raise OutOfTime
