"""Figures of the simulated benchmark (matplotlib's Agg canvas; pyplot and global
settings untouched)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .simulated import SimRow

__all__ = ["plot_bubbles"]


def plot_bubbles(rows: Sequence[SimRow], path: str | Path, title: str) -> None:
    """Write a PNG at ``path``: bubble ratio against micro-batches, a line per schedule
    (ours solid, torch's dashed), one subplot per PP, for the rows given (normally one cost
    profile). Rows without figures and the lower bound are left out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in rows if r.bubble_ratio is not None and r.source != "bound"]
    pps = sorted({r.pp for r in rows})
    names = list(dict.fromkeys(r.schedule for r in rows))
    fig = Figure(figsize=(4.2 * max(1, len(pps)) + 2.2, 4.0), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(pps)), squeeze=False)[0]
    colours = {n: f"C{i % 10}" for i, n in enumerate(names)}
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
    fig.savefig(str(path))
