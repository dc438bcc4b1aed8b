"""PNG timeline of a simulated (or measured) step in the style of the DualPipe paper figure."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ...schedules.ir import Action, Kind
from ...schedules.simulate import SimResult

__all__ = ["figure_width", "to_png"]

RGB = tuple[float, float, float]


def _hex(code: str) -> RGB:
    """``#RRGGBB`` as matplotlib's 0..1 RGB."""
    red, green, blue = (int(code[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return red, green, blue


#: Per kind, the shade of the first and of the last chunk (DualPipe's two directions).
PALETTE: dict[Kind, tuple[RGB, RGB]] = {
    Kind.F: (_hex("#FCE3B0"), _hex("#F2A44E")),
    Kind.B: (_hex("#CFE5F7"), _hex("#6FA8DC")),
    Kind.W: (_hex("#E6DBF4"), _hex("#A688D6")),
    Kind.BW: (_hex("#D4EDC6"), _hex("#7CBF62")),
}
LABELS = {
    Kind.F: "Forward",
    Kind.B: "Backward for input (dX)",
    Kind.W: "Backward for weights (dW)",
    Kind.BW: "Full backward (dX + dW)",
}
EDGE = "#404040"
DPI = 100
#: Figure margins in inches: left (lane labels), right, top (title), bottom (axis, legend).
LEFT, RIGHT, TOP, AXIS_BOTTOM, LEGEND_ROW = 1.3, 0.5, 0.8, 0.6, 0.3
LANE_IN = 0.5
BOX = 0.8  # a box's share of its lane's height
MIN_FONT, MAX_FONT = 5.0, 10.0


def _shade(kind: Kind, chunk: int, num_chunks: int) -> RGB:
    """``kind``'s colour for ``chunk``: light for chunk 0, darker for later chunks."""
    light, dark = PALETTE[kind]
    t = chunk / (num_chunks - 1) if num_chunks > 1 else 0.5
    red, green, blue = (a + (b - a) * t for a, b in zip(light, dark, strict=True))
    return red, green, blue


class _Box(NamedTuple):
    """One rectangle to draw, in data coordinates (time, lane), and its label."""

    x0: float
    y0: float
    x1: float
    y1: float
    colour: RGB
    microbatch: int


class _SplitBox:
    """Legend entry and handler in one: a box split into a top and a bottom colour."""

    def __init__(self, top: RGB, bottom: RGB) -> None:
        self.top, self.bottom = top, bottom

    def legend_artist(self, legend: Any, orig_handle: Any, fontsize: float, handlebox: Any) -> Any:
        from matplotlib.patches import Rectangle

        x, y = handlebox.xdescent, handlebox.ydescent
        w, h = handlebox.width, handlebox.height
        transform = handlebox.get_transform()
        halves = [
            Rectangle(
                (x, y + h / 2 * i),
                w,
                h / 2,
                facecolor=colour,
                edgecolor=EDGE,
                linewidth=0.6,
                transform=transform,
            )
            for i, colour in enumerate((self.bottom, self.top))
        ]
        for half in halves:
            handlebox.add_artist(half)
        return halves[1]


def _boxes(action: Action, start: float, end: float, lane: int, num_chunks: int) -> list[_Box]:
    """The boxes drawing one action; an FB pair is split into its forward half on top and
    its backward half below."""
    top, bottom = lane + (1 - BOX) / 2, lane + (1 + BOX) / 2
    if action.kind is not Kind.FB:
        colour = _shade(action.kind, action.chunk, num_chunks)
        return [_Box(start, top, end, bottom, colour, action.microbatch)]
    middle = lane + 0.5
    return [
        _Box(start, y0, end, y1, _shade(half.kind, half.chunk, num_chunks), half.microbatch)
        for half, (y0, y1) in zip(action.sub, ((top, middle), (middle, bottom)), strict=True)
    ]


def _numbers(boxes: list[_Box], px_per_unit: float, ax: Any) -> Any:
    """One collection of glyph outlines writing box micro-batch numbers in one font size
    (far faster to draw than one text artist per box): the largest that fits the widest
    number into nine boxes in ten (the narrowest tenth aside: a measured step's few short
    actions) and a half lane, at least ``MIN_FONT``; a box too narrow for its number at that
    size stays unnumbered."""
    from matplotlib.collections import PathCollection
    from matplotlib.textpath import TextPath
    from matplotlib.transforms import Affine2D

    widths = sorted((b.x1 - b.x0) * px_per_unit for b in boxes)
    reference = widths[len(widths) // 10] if widths else 0.0
    widest = max((len(str(b.microbatch)) for b in boxes), default=1)
    unit = TextPath((0, 0), "8" * widest, size=1).get_extents().width * DPI / 72
    font = max(MIN_FONT, min(MAX_FONT, LANE_IN * BOX / 2 * 72 * 0.75, 0.8 * reference / unit))
    glyphs: dict[int, Any] = {}
    glyph_px: dict[int, float] = {}
    for microbatch in sorted({b.microbatch for b in boxes}):
        path = TextPath((0, 0), str(microbatch), size=font)
        ext = path.get_extents()
        centre = Affine2D().translate(-(ext.x0 + ext.x1) / 2, -(ext.y0 + ext.y1) / 2)
        glyphs[microbatch] = path.transformed(centre)
        glyph_px[microbatch] = ext.width * DPI / 72
    labelled = [b for b in boxes if glyph_px[b.microbatch] <= 0.8 * (b.x1 - b.x0) * px_per_unit]
    return PathCollection(
        [glyphs[b.microbatch] for b in labelled],
        offsets=[((b.x0 + b.x1) / 2, (b.y0 + b.y1) / 2) for b in labelled] or None,
        offset_transform=ax.transData,
        transform=Affine2D().scale(1 / 72) + ax.figure.dpi_scale_trans,  # points to pixels
        facecolors="black",
        edgecolors="none",
    )


def figure_width(span: float, shortest: float) -> float:
    """The figure width (inches) :func:`to_png` picks for a time axis of ``span`` whose
    shortest action lasts ``shortest``: wide enough to tell actions apart, 8 to 24 in."""
    return min(max(LEFT + RIGHT + 0.3 * span / shortest, 8.0), 24.0)


def _headline(result: SimResult, title: str | None, unit: str | None) -> str:
    peak = max((r.peak_activations for r in result.ranks), default=0)
    makespan = f"{result.makespan:.4g}" + (f" {unit}" if unit else "")
    return (
        f"{title or result.schedule.name}\n"
        f"PP={len(result.ranks)}, micro-batches={result.schedule.num_microbatches}, "
        f"makespan={makespan}, bubble ratio={result.bubble_ratio:.1%}, "
        f"peak activations={peak}"
    )


def to_png(
    result: SimResult,
    path: str,
    title: str | None = None,
    *,
    unit: str | None = None,
    span: float | None = None,
    width: float | None = None,
) -> None:
    """Draw ``result`` as a PNG at ``path``: a lane per rank ("pipeline rank N", rank 0 on
    top), a box per action coloured by kind and shaded by chunk, micro-batch numbers where
    they fit, idle time white, a legend, and ``title`` (default: the schedule name) with the
    headline figures. The time axis is labelled with ``unit`` (default: the cost model's
    units) and runs to ``span`` (default: the makespan) with a margin; ``width`` (inches)
    fixes the figure's width, so that two pictures drawn with the same ``span`` and
    ``width`` share one time scale. Uses matplotlib's Agg canvas directly; pyplot and global
    settings are untouched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    timed = [(lane, t) for lane, r in enumerate(result.ranks) for t in r.actions]
    num_ranks = len(result.ranks)
    num_chunks = 1 + max((h.chunk for _, t in timed for h in t.action.computes), default=0)
    makespan = span or result.makespan or 1.0
    shortest = min((t.end - t.start for _, t in timed if t.end > t.start), default=makespan)
    # DualPipe's two model copies run in opposite directions: there a chunk is a direction.
    part = "direction" if result.schedule.placement.kind == "mirror" else "chunk"

    handles: list[Any] = [
        Patch(
            facecolor=_shade(kind, chunk, num_chunks),
            edgecolor=EDGE,
            linewidth=0.6,
            label=LABELS[kind] + (f", {part} {chunk}" if num_chunks > 1 else ""),
        )
        for kind in PALETTE
        for chunk in range(num_chunks)
        if any(h.kind is kind and h.chunk == chunk for _, t in timed for h in t.action.computes)
    ]
    labels = [h.get_label() for h in handles]
    handler_map = {}
    pair = next((t.action for _, t in timed if t.action.kind is Kind.FB), None)
    if pair is not None:
        forward, backward = pair.sub
        split = _SplitBox(
            _shade(forward.kind, forward.chunk, num_chunks),
            _shade(backward.kind, backward.chunk, num_chunks),
        )
        handles.append(split)
        labels.append("Overlapped forward & backward")
        handler_map[split] = split

    if width is None:
        width = figure_width(makespan, shortest)
    columns = max(1, min(len(handles), int((width - LEFT) // 2.6)))
    bottom = AXIS_BOTTOM + LEGEND_ROW * math.ceil(len(handles) / columns) + 0.2
    height = TOP + bottom + LANE_IN * num_ranks
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes(
        (LEFT / width, bottom / height, 1 - (LEFT + RIGHT) / width, LANE_IN * num_ranks / height)
    )

    boxes = [b for lane, t in timed for b in _boxes(t.action, t.start, t.end, lane, num_chunks)]
    px_per_unit = (width - LEFT - RIGHT) * DPI / makespan
    ax.add_collection(
        PolyCollection(
            [[(b.x0, b.y0), (b.x0, b.y1), (b.x1, b.y1), (b.x1, b.y0)] for b in boxes],
            facecolors=[b.colour for b in boxes],
            edgecolors=EDGE,
            linewidths=0.6 if shortest * px_per_unit >= 8 else 0.25,
        )
    )
    ax.add_collection(_numbers(boxes, px_per_unit, ax))

    ax.set_xlim(0, makespan * 1.01)
    ax.set_ylim(num_ranks, 0)
    ax.set_yticks(
        [lane + 0.5 for lane in range(num_ranks)],
        [f"pipeline rank {lane}" for lane in range(num_ranks)],
    )
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel(f"time ({unit or 'cost units'})")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.suptitle(_headline(result, title, unit), y=1 - 0.1 / height, va="top", fontsize=12)
    fig.legend(
        handles,
        labels,
        handler_map=handler_map,
        loc="lower center",
        ncol=columns,
        frameon=False,
        bbox_to_anchor=(0.5, 0.1 / height),
    )
    fig.savefig(path, dpi=DPI)
