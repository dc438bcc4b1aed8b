"""A progress line for long command-line work, drawn on a terminal only.

:class:`Progress` draws on ``stream`` (stderr by default) from a background thread, so
work that reports nothing (a generator) still shows its elapsed time, and work that
reports often pays only an attribute store. Nothing is drawn before ``delay_s`` (quick
runs print nothing), nor when ``stream`` is not a terminal or ``CI`` is set; the line is
cut to the terminal's width and erased at the end. Pure Python: no torch.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

__all__ = ["Progress", "StatusLine"]


class Progress:
    """``with Progress() as bar: bar.phase("simulating", total=n); bar.done = k; ...``;
    ``bar.note`` (a throughput, say) is drawn after the label."""

    WIDTH = 30

    def __init__(
        self, stream: TextIO | None = None, *, delay_s: float = 2.0, every_s: float = 0.25
    ):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() and not os.environ.get("CI")
        self.delay_s, self.every_s = delay_s, every_s
        self.label, self.total, self.done, self.note = "", 0, 0, ""
        self._began = time.monotonic()
        self._phase_began = self._began
        self._stop = threading.Event()
        self._drawn = False
        self._thread: threading.Thread | None = None

    def phase(self, label: str, total: int = 0) -> None:
        """Start a phase: ``total`` units to do (0: unknown, elapsed time only)."""
        self.label, self.total, self.done, self.note = label, total, 0, ""
        self._phase_began = time.monotonic()

    def line(self) -> str:
        """The line as drawn now."""
        elapsed = time.monotonic() - self._phase_began
        note = f", {self.note}" if self.note else ""
        if self.total <= 0:
            return f" {self.label} ... {elapsed:.0f} s{note}"
        share = min(self.done / self.total, 1.0)
        filled = int(self.WIDTH * share)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        return f" [{bar}] {share:4.0%} {self.label} ({elapsed:.0f} s{note})"

    def __enter__(self) -> Progress:
        if self.enabled:
            self._thread = threading.Thread(target=self._draw, name="progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def _draw(self) -> None:
        if self._stop.wait(self.delay_s):
            return
        while not self._stop.is_set():
            width = shutil.get_terminal_size().columns - 1
            self.stream.write("\r\x1b[K" + self.line()[:width])
            self.stream.flush()
            self._drawn = True
            self._stop.wait(self.every_s)


class StatusLine:
    """One line of progress on stderr, rewritten in place, when stderr is a terminal and
    ``CI`` is unset; silent otherwise. Call :meth:`clear` before printing results."""

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty() and not os.environ.get("CI")
        self.last = 0.0

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if self.enabled and now - self.last > 0.1:
            self.last = now
            sys.stderr.write(f"\r\x1b[K{text[: shutil.get_terminal_size().columns - 1]}")
            sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
