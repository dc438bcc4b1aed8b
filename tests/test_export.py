"""Contracts of the schedule exports: text grid, Chrome/Perfetto trace and PNG figure."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_dualpipe.planner.export import to_chrome_trace, to_grid, to_png, write_chrome_trace
from megatron_dualpipe.schedules.cost import CostModel
from megatron_dualpipe.schedules.ir import Kind
from megatron_dualpipe.schedules.registry import generate
from megatron_dualpipe.schedules.simulate import SimResult, simulate

FB_COST = CostModel(f=1, b=1, w=1, fb=2.5)
CASES = [
    ("dualpipev", 4, 10),
    ("dualpipev", 8, 32),
    ("dualpipe", 4, 8),
    ("1f1b", 4, 8),
    ("interleaved-1f1b", 4, 8),
    ("zb1p", 6, 12),
]
#: Colour names Chrome's trace viewer reserves (a subset; the exporter must pick from these).
CHROME_COLOURS = {
    "thread_state_running",
    "thread_state_runnable",
    "thread_state_iowait",
    "generic_work",
    "good",
    "bad",
    "terrible",
    "yellow",
    "olive",
    "rail_response",
    "rail_animation",
    "rail_idle",
    "rail_load",
    "startup",
}
#: One grid label: an FB pair, or a forward / dX / dW / full backward.
GRID_LABEL = re.compile(r"F\d+[bB]\d+|[bwB]?\d+")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _simulate(name: str, ranks: int, microbatches: int) -> SimResult:
    return simulate(generate(name, ranks, microbatches), FB_COST)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-pp{c[1]}-mb{c[2]}")
def result(request: pytest.FixtureRequest) -> SimResult:
    return _simulate(*request.param)


def _rows(grid: str) -> list[str]:
    return [line for line in grid.splitlines() if line.startswith("rank ")]


# -- grid ---------------------------------------------------------------------------------
def test_grid_has_one_row_per_rank_and_a_legend(result: SimResult) -> None:
    grid = to_grid(result)
    rows = _rows(grid)
    assert [row.split("|")[0].split() for row in rows] == [
        ["rank", str(r)] for r in range(len(result.ranks))
    ]
    assert len({len(row) for row in rows}) == 1  # all rows span the same time
    assert grid.splitlines()[-1].startswith("legend:")
    assert grid.splitlines()[0].startswith(result.schedule.name)


def test_grid_labels_every_action_and_microbatch(result: SimResult) -> None:
    rows = _rows(to_grid(result))
    for row, stats in zip(rows, result.ranks, strict=True):
        labels = GRID_LABEL.findall(row.split("|")[1])
        assert len(labels) == len(stats.actions)
    shown = {int(n) for row in rows for n in re.findall(r"\d+", row.split("|")[1])}
    assert shown == set(range(result.schedule.num_microbatches))


def test_grid_marks_idle_time_and_kinds() -> None:
    grid = to_grid(_simulate("zb1p", 4, 8))
    first, last = _rows(grid)[0], _rows(grid)[-1]
    assert "." in first.split("|")[1]  # rank 0 waits for the first gradient
    assert "b0" in last and "w0" in last
    dualpipev = to_grid(_simulate("dualpipev", 4, 10))
    assert re.search(r"F\d+B\d+", dualpipev)  # overlapped pairs are marked


def test_grid_width_caps_the_timeline() -> None:
    result = _simulate("dualpipev", 8, 32)
    wide = _rows(to_grid(result))[0].split("|")[1]
    narrow = _rows(to_grid(result, width=120))
    assert len(wide) > 120
    assert all(len(row.split("|")[1]) <= 120 for row in narrow)


# -- Chrome trace -------------------------------------------------------------------------
def _events(trace: dict, ph: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def test_trace_is_strict_json_with_one_slice_per_action(result: SimResult, tmp_path) -> None:
    path = tmp_path / "trace.json"
    write_chrome_trace(result, str(path))
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(to_chrome_trace(result)))
    slices = _events(trace, "X")
    assert len(slices) == sum(len(r.actions) for r in result.ranks)
    for event in slices:
        assert event["ts"] >= 0 and event["dur"] > 0
        assert event["cat"] in {k.value for k in Kind}
        assert event["cname"] in CHROME_COLOURS
        assert {"stage", "chunk", "microbatch"} <= event["args"].keys()
    first = result.ranks[0].actions[0]
    assert slices[0]["ts"] == first.start * 1000 and slices[0]["dur"] == pytest.approx(
        (first.end - first.start) * 1000
    )


def test_trace_has_a_named_track_per_rank(result: SimResult) -> None:
    trace = to_chrome_trace(result)
    names = {e["tid"]: e["args"]["name"] for e in _events(trace, "M") if e["name"] == "thread_name"}
    assert names == {r: f"rank {r}" for r in range(len(result.ranks))}
    assert {e["tid"] for e in _events(trace, "X")} == set(names)
    assert len({e["pid"] for e in trace["traceEvents"]}) == 1


def test_trace_fb_slices_carry_both_halves() -> None:
    result = _simulate("dualpipev", 4, 10)
    pairs = [e for e in _events(to_chrome_trace(result), "X") if e["cat"] == "FB"]
    expected = sum(t.action.kind is Kind.FB for r in result.ranks for t in r.actions)
    assert len(pairs) == expected > 0
    for event in pairs:
        forward, backward = event["args"]["forward"], event["args"]["backward"]
        assert event["name"].startswith(f"F mb{forward['microbatch']} s{forward['stage']} + B")
        assert event["name"].endswith(f" mb{backward['microbatch']} s{backward['stage']}")
        assert event["args"]["microbatch"] == forward["microbatch"]


def test_trace_flows_pair_up_inside_their_slices(result: SimResult) -> None:
    trace = to_chrome_trace(result)
    starts, finishes = _events(trace, "s"), _events(trace, "f")
    assert len(starts) == len(finishes) == len(result.messages) > 0
    assert sorted(e["id"] for e in starts) == sorted(e["id"] for e in finishes)
    slices: dict[int, list[tuple[float, float]]] = {}
    for e in _events(trace, "X"):
        slices.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    by_id = {e["id"]: e for e in finishes}
    for start, message in zip(starts, result.messages, strict=True):
        finish = by_id[start["id"]]
        assert (start["tid"], finish["tid"]) == (message.src, message.dst)
        assert (start["name"], start["cat"]) == (finish["name"], finish["cat"])
        assert finish["bp"] == "e"
        assert any(a < start["ts"] < b for a, b in slices[message.src])
        assert any(a < finish["ts"] < b for a, b in slices[message.dst])
        assert start["ts"] < finish["ts"]


def test_trace_accepts_a_measured_timeline() -> None:
    simulated = _simulate("1f1b", 4, 8)
    measured = SimpleNamespace(
        schedule=SimpleNamespace(name="measured"),
        ranks=[SimpleNamespace(actions=r.actions) for r in simulated.ranks],
        messages=simulated.messages,
    )
    trace = to_chrome_trace(measured, time_unit_us=1.0)  # type: ignore[arg-type]
    reference = to_chrome_trace(simulated, time_unit_us=1.0)
    assert _events(trace, "X") == _events(reference, "X")
    assert _events(trace, "s") == _events(reference, "s")
    assert trace["traceEvents"][0]["args"]["name"] == "measured"


# -- PNG ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ranks", "microbatches"), [(4, 10), pytest.param(16, 64, marks=pytest.mark.slow)]
)
def test_png_is_written(tmp_path, ranks: int, microbatches: int) -> None:
    from matplotlib.image import imread

    path = tmp_path / f"dualpipev_pp{ranks}_mb{microbatches}.png"
    to_png(_simulate("dualpipev", ranks, microbatches), str(path), title="DualPipeV")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(str(path))
    height, width, channels = image.shape
    assert channels in (3, 4) and width >= 800 and height >= 40 * ranks
    painted = (image[..., :3] < 0.97).any(axis=-1).mean()
    assert 0.1 < painted < 0.9  # boxes drawn, idle left white


def test_png_numbers_every_box_but_a_few_too_short_for_their_number() -> None:
    """A measured step has a few very short actions (a dW of one layer): they no longer
    shrink every number below the smallest font, which left a measured panel unnumbered."""
    from matplotlib.figure import Figure

    from megatron_dualpipe.planner.export.png import _Box, _numbers

    white = (1.0, 1.0, 1.0)
    boxes = [_Box(10.0 * i, 0.1, 10.0 * i + 9, 0.9, white, i) for i in range(12)]
    short = _Box(120.0, 0.1, 120.05, 0.9, white, 12)
    axes = Figure(dpi=100).add_axes((0, 0, 1, 1))
    assert len(_numbers(boxes, 4.0, axes).get_paths()) == 12
    assert len(_numbers([*boxes, short], 4.0, axes).get_paths()) == 12


def test_png_leaves_matplotlib_state_alone(tmp_path) -> None:
    import matplotlib

    backend, had_pyplot = matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules
    to_png(_simulate("1f1b", 4, 8), str(tmp_path / "1f1b.png"))
    assert matplotlib.get_backend() == backend
    assert ("matplotlib.pyplot" in sys.modules) == had_pyplot


def test_export_imports_matplotlib_lazily() -> None:
    code = "import sys, megatron_dualpipe.planner.export; print('matplotlib' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "False"
