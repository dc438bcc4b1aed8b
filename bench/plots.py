"""Figures of the simulated benchmark (matplotlib's Agg canvas; pyplot and global
settings untouched)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .simulated import SimRow

__all__ = ["bubble_figure", "line_colours", "plot_bubbles"]


def line_colours(names: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """A colour of its own for each of ``names``, from matplotlib's tab20 (ten hues, each
    dark and light): each schedule the next hue's dark shade, its optimised row
    (``<name>-opt``) the same hue's light shade, and what is left past ten hues a light
    shade nobody has. The benchmark draws 13 lines; the default cycle of 10 colours gave
    some the colour of another."""
    from matplotlib import colormaps

    palette = colormaps["tab20"].colors
    if len(names) > len(palette):
        raise ValueError(f"{len(names)} lines but {len(palette)} colours: plot fewer schedules")
    dark, light = palette[0::2], palette[1::2]
    base = {n: n.removesuffix("-opt") for n in names if n.endswith("-opt")}
    base = {n: b for n, b in base.items() if b in names}
    hue = {n: i for i, n in enumerate(n for n in names if n not in base)}
    colours = {}
    for name in names:
        i = hue[base.get(name, name)]
        if i < len(dark):
            colours[name] = light[i] if name in base else dark[i]
    spare = iter(c for c in light if c not in colours.values())
    return {name: colours[name] if name in colours else next(spare) for name in names}


def bubble_figure(rows: Sequence[SimRow], title: str) -> Any:
    """The figure :func:`plot_bubbles` writes: bubble ratio against micro-batches, a line
    per schedule, each in its own colour (ours solid with dots, torch's dashed with
    crosses), one subplot per PP, for the rows given (normally one cost profile). Rows
    without figures and the lower bound are left out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in rows if r.bubble_ratio is not None and r.source != "bound"]
    pps = sorted({r.pp for r in rows})
    names = list(dict.fromkeys(r.schedule for r in rows))
    fig = Figure(figsize=(4.2 * max(1, len(pps)) + 2.2, 4.0), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(pps)), squeeze=False)[0]
    colours = line_colours(names)
    for ax, pp in zip(axes, pps, strict=False):
        for name in names:
            points = sorted(
                (r.microbatches, 100 * r.bubble_ratio)
                for r in rows
                if r.pp == pp and r.schedule == name
            )
            if not points:
                continue
            torch = any(r.source == "torch" for r in rows if r.schedule == name)
            ax.plot(
                [m for m, _ in points],
                [b for _, b in points],
                linestyle="--" if torch else "-",
                marker="x" if torch else "o",
                color=colours[name],
                label=name,
            )
        counts = sorted({r.microbatches for r in rows if r.pp == pp})
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts)
        ax.set_xticklabels([str(m) for m in counts])
        ax.set_title(f"PP={pp}")
        ax.set_xlabel("micro-batches")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("bubble ratio (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.suptitle(f"Simulated bubble ratio, {title} (costs per rank share)")
    fig.subplots_adjust(left=0.06, right=0.80, bottom=0.14, top=0.85, wspace=0.25)
    return fig


def plot_bubbles(rows: Sequence[SimRow], path: str | Path, title: str) -> None:
    """Write :func:`bubble_figure` of ``rows`` as a PNG at ``path``."""
    bubble_figure(rows, title).savefig(str(path))
