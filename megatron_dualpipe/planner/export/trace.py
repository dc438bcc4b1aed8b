"""Chrome / Perfetto trace-event JSON of a simulated (or measured) step."""

from __future__ import annotations

import json
from typing import Any

from ...schedules.ir import Action, Kind
from ...schedules.simulate import Message, SimResult, TimedAction

__all__ = ["to_chrome_trace", "write_chrome_trace"]

PID = 0
#: Chrome's reserved colour names (catapult's ColorScheme), one per compute kind.
CNAME = {
    Kind.F: "rail_response",
    Kind.B: "rail_load",
    Kind.W: "rail_idle",
    Kind.BW: "good",
    Kind.FB: "rail_animation",
}
#: How far inside its slice a flow end is placed, as a fraction of the slice, so viewers bind it.
_INSET = 0.01

_SliceKey = tuple[int, str, int, int]  # (rank, "F" or "B", stage, micro-batch)


def _name(action: Action) -> str:
    """``F mb3 s1``; an FB pair joins its halves: ``F mb7 s0 + BW mb3 s7``."""
    if action.kind is Kind.FB:
        return " + ".join(_name(half) for half in action.sub)
    return f"{action.kind.value} mb{action.microbatch} s{action.stage}"


def _args(action: Action) -> dict[str, Any]:
    """Stage, chunk and micro-batch (the forward half's for FB, whose halves are nested)."""
    args: dict[str, Any] = {
        "stage": action.stage,
        "chunk": action.chunk,
        "microbatch": action.microbatch,
    }
    if action.kind is Kind.FB:
        forward, backward = action.sub
        args |= {"forward": _args(forward), "backward": _args(backward)}
    return args


def _us(t: float, time_unit_us: float) -> float:
    """``t`` time units in microseconds, rounded to the nanosecond."""
    return round(t * time_unit_us, 3)


def _slices(result: SimResult) -> dict[_SliceKey, TimedAction]:
    """Each rank's timed actions by the forward or backward half they contain."""
    index: dict[_SliceKey, TimedAction] = {}
    for rank, stats in enumerate(result.ranks):
        for timed in stats.actions:
            for half in timed.action.computes:
                if half.kind is not Kind.W:
                    direction = "F" if half.kind is Kind.F else "B"
                    index[(rank, direction, half.stage, half.microbatch)] = timed
    return index


def _inside(t: float, timed: TimedAction | None) -> float:
    """``t`` moved just inside ``timed`` (unchanged when the slice is unknown)."""
    if timed is None:
        return t
    inset = (timed.end - timed.start) * _INSET
    return min(max(t, timed.start + inset), timed.end - inset)


def _flow_ends(message: Message, slices: dict[_SliceKey, TimedAction]) -> tuple[float, float, str]:
    """Send and arrival times bound to the producing and consuming slices, and a name.

    Stages are numbered in data-flow order, so an activation for stage ``s`` comes from the
    forward of ``s - 1`` and a gradient for ``s`` from the backward of ``s + 1``.
    """
    mb, stage = message.microbatch, message.stage
    if message.kind is Kind.RECV_F:
        producer = slices.get((message.src, "F", stage - 1, mb))
        consumer = slices.get((message.dst, "F", stage, mb))
        name = f"activation mb{mb} s{stage - 1}->s{stage}"
    else:
        producer = slices.get((message.src, "B", stage + 1, mb))
        consumer = slices.get((message.dst, "B", stage, mb))
        name = f"gradient mb{mb} s{stage + 1}->s{stage}"
    return _inside(message.sent, producer), _inside(message.arrived, consumer), name


def _meta(event: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    """A metadata event (``process_name``, ``thread_name``, ...) for the process or a track."""
    return {"ph": "M", "pid": PID, "tid": tid, "name": event, "args": args}


def to_chrome_trace(result: SimResult, time_unit_us: float = 1000.0) -> dict:
    """Trace events for ``result``: a track "rank N" per rank, an X slice per compute action
    and an s/f flow pair per message; one time unit becomes ``time_unit_us`` microseconds.

    Reads only ``schedule.name``, ``ranks[i].actions`` and ``messages``, so a measured
    timeline wrapped in a SimResult exports the same way. FB slices carry both halves in
    their name and args. Flow ends sit just inside the producing and consuming slices.
    """
    events = [_meta("process_name", 0, {"name": result.schedule.name})]
    for rank, stats in enumerate(result.ranks):
        events.append(_meta("thread_name", rank, {"name": f"rank {rank}"}))
        events.append(_meta("thread_sort_index", rank, {"sort_index": rank}))
        for timed in stats.actions:
            action = timed.action
            events.append(
                {
                    "ph": "X",
                    "pid": PID,
                    "tid": rank,
                    "name": _name(action),
                    "cat": action.kind.value,
                    "cname": CNAME[action.kind],
                    "ts": _us(timed.start, time_unit_us),
                    "dur": _us(timed.end - timed.start, time_unit_us),
                    "args": _args(action),
                }
            )
    slices = _slices(result)
    for flow_id, message in enumerate(result.messages):
        sent, arrived, name = _flow_ends(message, slices)
        common = {"pid": PID, "id": flow_id, "name": name, "cat": message.kind.value}
        events.append({**common, "ph": "s", "tid": message.src, "ts": _us(sent, time_unit_us)})
        events.append(
            {**common, "ph": "f", "bp": "e", "tid": message.dst, "ts": _us(arrived, time_unit_us)}
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SimResult, path: str, time_unit_us: float = 1000.0) -> None:
    """Write :func:`to_chrome_trace` of ``result`` to ``path`` as strict JSON."""
    with open(path, "w") as f:
        json.dump(to_chrome_trace(result, time_unit_us), f, allow_nan=False)
