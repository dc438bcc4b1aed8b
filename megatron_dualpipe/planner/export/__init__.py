"""Exports of a simulated (or measured) step: text grid, Chrome/Perfetto trace, PNG figure.

Pure Python; matplotlib is imported only when :func:`to_png` runs.
"""

from __future__ import annotations

from .grid import to_grid
from .png import figure_width, to_png
from .trace import to_chrome_trace, write_chrome_trace

__all__ = ["figure_width", "to_chrome_trace", "to_grid", "to_png", "write_chrome_trace"]
