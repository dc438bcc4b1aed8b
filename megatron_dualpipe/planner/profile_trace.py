"""Schedule costs from a PyTorch profiler trace (Chrome trace JSON, plain or gzipped).
Pure Python: reading a trace needs neither torch nor a GPU.

:func:`read_profile` reads the trace's ``record_function`` spans as phases, each timed by
the GPU work its launches started (matched by ``correlation`` id, stream by stream), or by
the spans' own duration in a trace without GPU work. It understands DeepSeek's phase names
and this project's executor's, and refuses others in one sentence.
:meth:`TraceCosts.cost_model` turns them into F, B, W and an F&B pair's ``overlap``. What
is read and how: docs/schedules.md, "The simulator" (costs from a profile).
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..schedules.cost import CostModel
from ..schedules.ir import ScheduleError

__all__ = ["Phase", "TraceCosts", "read_profile"]

#: Event categories of host calls that start GPU work, and of that work.
_LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
_GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_DEEPSEEK = re.compile(r"^(?P<module>[A-Za-z_][\w.]*)\((?P<part>[FBW])\)$")
_ACTION = re.compile(r"^(?P<kind>FB/BW|FB/F|FB|BW|F|B|W) stage=\d+ mb=\d+")
_COMM = ("dispatch", "combine", "a2a", "all_to_all", "alltoall")


@dataclass(frozen=True)
class Phase:
    """One phase name: ``count`` occurrences, ``ms`` per occurrence (GPU work over all
    streams, or the span's CPU time in a trace without GPU work), ``streams`` its GPU ms per
    occurrence by stream, ``cpu_ms`` the span's own duration per occurrence."""

    name: str
    count: int
    ms: float
    streams: dict[str, float]
    cpu_ms: float

    def to_json(self) -> dict:
        return {"ms": self.ms, "count": self.count, "streams": self.streams, "cpu_ms": self.cpu_ms}


@dataclass(frozen=True)
class TraceCosts:
    """What :func:`read_profile` found; times in milliseconds per layer (``unit``)."""

    path: str
    device: str  # "GPU": kernel times; "CPU": span durations (no GPU work in the trace)
    spelling: str  # "deepseek" or "executor"
    unit: str  # "layer" or "stage"
    phases: dict[str, Phase]
    f: float
    b: float
    w: float
    a2a_forward: float
    a2a_backward: float
    pair_wall: float | None
    pair_parts: float | None
    compute_busy: float | None
    compute_streams: tuple[str, ...]
    notes: list[str] = field(default_factory=list)

    @property
    def overlap(self) -> float:
        """An F&B pair's wall time over the sum of its parts (1.0: no pair in the trace)."""
        if self.pair_wall is None or not self.pair_parts:
            return 1.0
        return self.pair_wall / self.pair_parts

    def cost_model(self, latency: float = 0.0) -> CostModel:
        """The simulator's costs: F and B with their all-to-all (and its share of each), W,
        and the pair's overlap."""
        f, b = self.f + self.a2a_forward, self.b + self.a2a_backward
        return CostModel(
            f=f,
            b=b,
            w=self.w,
            overlap=self.overlap,
            latency=latency,
            a2a_f=self.a2a_forward / f if f else 0.0,
            a2a_b=self.a2a_backward / b if b else 0.0,
        )

    def cost_text(self) -> str:
        """:meth:`cost_model` as ``--cost`` arguments."""
        c = self.cost_model()
        return (
            f"F={c.f:.6g},B={c.b:.6g},W={c.w:.6g},overlap={c.overlap:.6g},"
            f"a2a_f={c.a2a_f:.6g},a2a_b={c.a2a_b:.6g}"
        )

    def report(self) -> str:
        """The figures as lines for the terminal."""
        source = "GPU kernel time" if self.device == "GPU" else "CPU span time (no GPU work)"
        u = self.unit
        lines = [f"profile {self.path}: {len(self.phases)} phases, {source}, ms per {u}"]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [
            f"  F  (forward) compute      {self.f:9.3f} ms",
            f"  B  (dX) compute           {self.b:9.3f} ms",
            f"  W  (dW) compute           {self.w:9.3f} ms",
            f"  all-to-all, forward       {self.a2a_forward:9.3f} ms",
            f"  all-to-all, backward      {self.a2a_backward:9.3f} ms",
        ]
        if self.pair_wall is not None and self.pair_parts:
            lines.append(
                f"  F&B pair: wall {self.pair_wall:.3f} ms vs its parts' sum "
                f"{self.pair_parts:.3f} ms (overlap {self.overlap:.3f})"
            )
        else:
            lines.append("  F&B pair: none in the trace (overlap 1.0)")
        if self.compute_busy is not None:
            streams = ", ".join(self.compute_streams)
            lines.append(
                f"  compute streams ({streams}) busy {100 * self.compute_busy:.1f}% of the pair"
            )
        lines.append(f"  cost model: --cost {self.cost_text()} --cost-per stage (ms per {u})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The stable ``simulate --profile --json`` shape of the figures."""
        return {
            "trace": self.path,
            "device": self.device,
            "spelling": self.spelling,
            "unit": self.unit,
            "phases": {name: p.to_json() for name, p in self.phases.items()},
            "per_unit": {
                "F": self.f,
                "B": self.b,
                "W": self.w,
                "a2a_forward": self.a2a_forward,
                "a2a_backward": self.a2a_backward,
                "pair_wall": self.pair_wall,
                "pair_parts": self.pair_parts,
                "compute_busy": self.compute_busy,
                "compute_streams": list(self.compute_streams),
            },
            "cost": self.cost_text(),
            "notes": self.notes,
        }


@dataclass
class _Span:
    name: str
    pid: object
    start: float
    end: float
    work: list[dict] = field(default_factory=list)  # GPU events its launches started


def _load(path: Path) -> list[dict]:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ScheduleError(f"--profile: cannot read {path}: {err.strerror}") from None
    try:
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        data = json.loads(text)
    except (OSError, ValueError, EOFError):
        raise ScheduleError(
            f"--profile: {path} is not a Chrome trace (JSON, plain or gzipped): give the "
            "file a PyTorch profiler's export_chrome_trace or trace handler wrote"
        ) from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ScheduleError(
            f"--profile: {path} has no traceEvents list: give a PyTorch profiler trace"
        )
    return [e for e in events if isinstance(e, dict)]


def _spans_with_work(events: list[dict]) -> tuple[list[_Span], bool]:
    """The annotation spans, each with the GPU work its launches started; and whether the
    trace holds any GPU work at all."""
    gpu: dict[object, list[dict]] = defaultdict(list)
    launches: dict[object, list[tuple[float, object]]] = defaultdict(list)
    spans = []
    for e in events:
        cat, args = str(e.get("cat", "")).lower(), e.get("args") or {}
        if e.get("ph") != "X":
            continue
        if cat in _GPU_CATEGORIES and "correlation" in args:
            gpu[args["correlation"]].append(e)
        elif cat in _LAUNCH_CATEGORIES and "correlation" in args:
            launches[e.get("pid")].append((float(e["ts"]), args["correlation"]))
        elif cat == "user_annotation" and not str(e.get("name", "")).startswith("ProfilerStep#"):
            start = float(e["ts"])
            spans.append(_Span(str(e["name"]), e.get("pid"), start, start + float(e["dur"])))
    for calls in launches.values():
        calls.sort(key=lambda c: c[0])
    times = {pid: [t for t, _ in calls] for pid, calls in launches.items()}
    for span in spans:
        calls = launches.get(span.pid, [])
        lo = bisect.bisect_left(times.get(span.pid, []), span.start)
        hi = bisect.bisect_right(times.get(span.pid, []), span.end)
        for _, correlation in calls[lo:hi]:
            span.work += gpu.get(correlation, [])
    return spans, bool(gpu)


def _ms(events: list[dict]) -> dict[str, float]:
    by_stream: dict[str, float] = defaultdict(float)
    for e in events:
        by_stream[str((e.get("args") or {}).get("stream", e.get("tid")))] += float(e["dur"]) / 1e3
    return dict(by_stream)


def _union_ms(events: list[dict]) -> float:
    """The time at least one of ``events`` runs, in ms."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def _phases(spans: list[_Span], on_gpu: bool) -> dict[str, Phase]:
    grouped: dict[str, list[_Span]] = defaultdict(list)
    for span in spans:
        grouped[span.name].append(span)
    out = {}
    for name, group in grouped.items():
        n = len(group)
        cpu = sum(s.end - s.start for s in group) / 1e3 / n
        streams = {k: v / n for k, v in sorted(_ms([w for s in group for w in s.work]).items())}
        ms = sum(streams.values()) if on_gpu else cpu
        out[name] = Phase(name, n, ms, streams, cpu)
    return out


def _wall_ms(span: _Span, on_gpu: bool) -> float:
    if not on_gpu:
        return (span.end - span.start) / 1e3
    if not span.work:
        return 0.0
    start = min(float(e["ts"]) for e in span.work)
    end = max(float(e["ts"]) + float(e["dur"]) for e in span.work)
    return (end - start) / 1e3


def _time(span: _Span, on_gpu: bool) -> float:
    """One span's time: its GPU work's over all streams, or its own on a CPU trace."""
    return sum(_ms(span.work).values()) if on_gpu else (span.end - span.start) / 1e3


def _is_comm(module: str) -> bool:
    return any(word in module.lower() for word in _COMM)


def _deepseek(path: str, spans: list[_Span], on_gpu: bool, phases: dict[str, Phase]) -> TraceCosts:
    parts: dict[tuple[bool, str], float] = defaultdict(float)
    for name, phase in phases.items():
        m = _DEEPSEEK.match(name)
        if m:
            parts[(_is_comm(m["module"]), m["part"])] += phase.ms
    inner = [s for s in spans if _DEEPSEEK.match(s.name)]
    # An F&B pair: a span holding forward and backward phases (the smallest such).
    pairs = []
    for span in spans:
        held = [s for s in inner if span.start <= s.start and s.end <= span.end and s is not span]
        passes = {_DEEPSEEK.match(s.name)["part"] for s in held}
        if {"F", "B"} <= passes:
            pairs.append((span.end - span.start, span, held))
    notes = []
    wall = parts_sum = busy = None
    compute_streams: tuple[str, ...] = ()
    if pairs:
        _, pair, held = min(pairs, key=lambda p: p[0])
        forwards = defaultdict(int)
        for s in held:
            m = _DEEPSEEK.match(s.name)
            if m["part"] == "F" and not _is_comm(m["module"]):
                forwards[s.name] += 1
        layers = max(forwards.values(), default=1)
        wall = _wall_ms(pair, on_gpu) / layers
        parts_sum = sum(_time(s, on_gpu) for s in held) / layers
        notes.append(f"the F&B pair is span {pair.name!r}: {layers} layers forward and backward")
        if on_gpu:
            # A compute stream: one that runs more of the compute phases' work than of the
            # all-to-all's (a stream of weight-gradient GEMMs counts; DeepEP's does not).
            share: dict[str, float] = defaultdict(float)
            for s in held:
                sign = -1.0 if _is_comm(_DEEPSEEK.match(s.name)["module"]) else 1.0
                for stream, ms in _ms(s.work).items():
                    share[stream] += sign * ms
            compute_streams = tuple(sorted(k for k, v in share.items() if v > 0))
            on_streams = [
                w
                for w in pair.work
                if str((w.get("args") or {}).get("stream", w.get("tid"))) in compute_streams
            ]
            busy = _union_ms(on_streams) / (wall * layers) if wall else None
    return TraceCosts(
        path,
        "GPU" if on_gpu else "CPU",
        "deepseek",
        "layer",
        phases,
        f=parts[(False, "F")],
        b=parts[(False, "B")],
        w=parts[(False, "W")],
        a2a_forward=parts[(True, "F")],
        a2a_backward=parts[(True, "B")],
        pair_wall=wall,
        pair_parts=parts_sum,
        compute_busy=busy,
        compute_streams=compute_streams,
        notes=notes,
    )


def _executor(path: str, spans: list[_Span], on_gpu: bool, phases: dict[str, Phase]) -> TraceCosts:
    times: dict[str, list[float]] = defaultdict(list)
    halves = [s for s in spans if s.name.startswith("FB/")]
    pair_parts: list[float] = []
    for span in spans:
        m = _ACTION.match(span.name)
        if not m:
            continue
        if m["kind"] == "FB":
            times["FB"].append(_wall_ms(span, on_gpu))
            inside = [h for h in halves if span.start <= h.start and h.end <= span.end]
            if inside:  # the halves ran one after the other: the pair's own parts
                pair_parts.append(sum(_time(h, on_gpu) for h in inside))
        else:
            times[m["kind"]].append(_time(span, on_gpu))
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    notes = []
    f = mean.get("F", mean.get("FB/F", 0.0))
    if "B" in mean or "W" in mean:
        b, w = mean.get("B", 0.0), mean.get("W", 0.0)
    else:
        b, w = mean.get("BW", mean.get("FB/BW", 0.0)), 0.0
        notes.append("no separate dX and dW actions (full backwards only): W is 0, B is dX+dW")
    wall = mean.get("FB")
    parts = None
    if wall is None:
        notes.append("no FB action in the trace, so no F&B pair to measure")
    elif len(pair_parts) == len(times["FB"]):
        parts = statistics.fmean(pair_parts)
        notes.append("the FB pairs ran as a forward, then a backward (not overlapped)")
    else:
        parts = f + mean.get("BW", b + w)
    return TraceCosts(
        path,
        "GPU" if on_gpu else "CPU",
        "executor",
        "stage",
        phases,
        f=f,
        b=b,
        w=w,
        a2a_forward=0.0,
        a2a_backward=0.0,
        pair_wall=wall,
        pair_parts=parts,
        compute_busy=None,
        compute_streams=(),
        notes=notes,
    )


def read_profile(path: str | Path) -> TraceCosts:
    """Read ``path`` (a PyTorch profiler Chrome trace) into per-layer figures and a cost
    model; :class:`ScheduleError` in one sentence where it is not such a trace or holds no
    phases this module understands."""
    path = Path(path)
    try:
        spans, on_gpu = _spans_with_work(_load(path))
    except (KeyError, TypeError, ValueError) as err:
        raise ScheduleError(
            f"--profile: {path} has an event without a readable {err}: give the trace as "
            "the PyTorch profiler wrote it"
        ) from None
    phases = _phases(spans, on_gpu)
    if any(_DEEPSEEK.match(n) for n in phases):
        costs = _deepseek(str(path), spans, on_gpu, phases)
    elif any(_ACTION.match(n) for n in phases):
        costs = _executor(str(path), spans, on_gpu, phases)
    else:
        found = ", ".join(sorted(phases)[:5]) or "none"
        raise ScheduleError(
            f"--profile: {path} has no phases this reader knows (record_function spans such "
            f"as attn(F) or mlp(B), or the executor's 'F stage=0 mb=0'; found: {found}): "
            "profile with train --profile, or name the phases so"
        )
    if not on_gpu:
        costs.notes.insert(0, "no GPU work in the trace (a CPU run): times are the spans' own")
    return costs
