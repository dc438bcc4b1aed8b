"""Measured timelines: record one rank's actions, gather all ranks' on rank 0.

The gathered result is a :class:`~megatron_dualpipe.schedules.simulate.SimResult`, so the
simulator's exports draw a measured step exactly as a simulated one, side by side with it.
A rank measures with :func:`clock_for`'s clock (the host's monotonic clock on CPU, CUDA
events on a GPU), from an origin the ranks align on. How the ranks' clocks are aligned, and
how well: docs/runtime.md, "Compute" (timeline).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..schedules.cost import CostModel
from ..schedules.ir import Action, Kind, Schedule
from ..schedules.simulate import Message, RankStats, SimResult, TimedAction

__all__ = [
    "DeviceClock",
    "HostClock",
    "RankTimeline",
    "aligned_timelines",
    "clock_for",
    "gather_timeline",
    "host_boot_id",
    "start_barrier",
]

#: ``(Kind.RECV_F or Kind.RECV_B, receiving stage, micro-batch)``, as in :mod:`.p2p`.
_Key = tuple[Kind, int, int]


class Clock(Protocol):
    def mark(self) -> Any: ...

    def resolve(self, marks: list[Any]) -> list[float]: ...


class HostClock:
    """Milliseconds of the host's monotonic clock since the clock was made; ``origin`` is
    that moment on the clock, in seconds."""

    def __init__(self) -> None:
        self.origin = time.monotonic()

    def mark(self) -> float:
        return (time.monotonic() - self.origin) * 1e3

    def resolve(self, marks: list[Any]) -> list[float]:
        return list(marks)


class DeviceClock:
    """CUDA events on the current stream; a mark is an event, read as milliseconds since
    the clock's first event once the last has completed (``event`` makes one:
    ``torch.cuda.Event(enable_timing=True)`` by default)."""

    def __init__(self, event: Callable[[], Any] | None = None) -> None:
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._origin = self._event()
        self._origin.record()

    def mark(self) -> Any:
        event = self._event()
        event.record()
        return event

    def resolve(self, marks: list[Any]) -> list[float]:
        if marks:
            marks[-1].synchronize()
        return [self._origin.elapsed_time(event) for event in marks]


def clock_for(device: torch.device | None, event: Callable[[], Any] | None = None) -> Clock:
    """The clock a rank whose work runs on ``device`` measures with (docs/runtime.md)."""
    if device is not None and device.type == "cuda":
        return DeviceClock(event)
    return HostClock()


def host_boot_id() -> str | None:
    """This host's boot id (the same for every process between two boots), or None where
    the system does not tell it."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip() or None
    except OSError:
        return None


def start_barrier(group: dist.ProcessGroup | None) -> None:
    """The barrier the ranks pass right before they start recording, over ``group``: on
    NCCL on the current CUDA device (``device_ids``), so that torch need not guess which
    GPU its one-element all-reduce runs on (it would pick the bound device, else the
    current one, with a warning)."""
    if "nccl" in str(dist.get_backend(group)):
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


@dataclass
class RankTimeline:
    """What one rank did in one step: its compute actions with start and end, the
    messages it sent (key, receiver, time) and received (key, sender, time), in ms once
    :meth:`resolve` d (until then, in ``clock``'s marks)."""

    rank: int
    peak_activations: int = 0
    actions: list[TimedAction] = field(default_factory=list)
    sent: list[tuple[_Key, int, float]] = field(default_factory=list)
    received: list[tuple[_Key, int, float]] = field(default_factory=list)
    clock: Clock | None = field(default_factory=HostClock, repr=False)
    wall_origin: float = field(default_factory=time.time)
    #: ``(boot id, origin)`` where the clock is the host's monotonic clock, else None.
    host_origin: tuple[str, float] | None = None

    def __post_init__(self) -> None:
        if self.host_origin is None and isinstance(self.clock, HostClock):
            boot_id = host_boot_id()
            self.host_origin = (boot_id, self.clock.origin) if boot_id else None

    def now(self) -> Any:
        """A mark of this moment on the timeline's clock (milliseconds on the host's)."""
        return self.clock.mark()

    def resolve(self) -> RankTimeline:
        """Turn every mark into milliseconds since the origin (waiting for the device where
        it measures with events) and drop the clock; idempotent."""
        if self.clock is None:
            return self
        marks = [m for a in self.actions for m in (a.start, a.end)]
        marks += [at for *_, at in self.sent] + [at for *_, at in self.received]
        ms = iter(self.clock.resolve(marks))
        self.actions = [TimedAction(a.action, next(ms), next(ms)) for a in self.actions]
        self.sent = [(key, peer, next(ms)) for key, peer, _ in self.sent]
        self.received = [(key, peer, next(ms)) for key, peer, _ in self.received]
        self.clock = None
        return self

    def shifted(self, ms: float) -> RankTimeline:
        """The same timeline with every time ``ms`` later."""
        return RankTimeline(
            self.rank,
            self.peak_activations,
            [TimedAction(t.action, t.start + ms, t.end + ms) for t in self.actions],
            [(key, peer, at + ms) for key, peer, at in self.sent],
            [(key, peer, at + ms) for key, peer, at in self.received],
            None,
            self.wall_origin,
            self.host_origin,
        )

    def add(self, action: Action, start: float, end: float) -> None:
        self.actions.append(TimedAction(action, start, end))


def _fitted_cost(timelines: list[RankTimeline]) -> CostModel:
    """Mean measured duration per kind; BW splits into B and W where those were measured,
    else counts wholly as B."""
    durations: dict[Kind, list[float]] = {}
    for timeline in timelines:
        for timed in timeline.actions:
            durations.setdefault(timed.action.kind, []).append(timed.end - timed.start)
    mean = {kind: statistics.fmean(values) for kind, values in durations.items()}
    f = mean.get(Kind.F, 0.0)
    if Kind.B in mean or Kind.W in mean:
        b, w = mean.get(Kind.B, 0.0), mean.get(Kind.W, 0.0)
    else:
        b, w = mean.get(Kind.BW, 0.0), 0.0
    return CostModel(f=f, b=b, w=w, fb=mean.get(Kind.FB))


def aligned_timelines(timelines: list[RankTimeline]) -> list[RankTimeline]:
    """The timelines on one time axis, 0 at the earliest origin: by their monotonic origins
    where all were measured on one host's monotonic clock, else by their wall origins."""
    hosts = {t.host_origin[0] if t.host_origin else None for t in timelines}
    if len(hosts) == 1 and None not in hosts:
        origins = [t.host_origin[1] for t in timelines]
    else:
        origins = [t.wall_origin for t in timelines]
    start = min(origins)
    return [t.shifted((origin - start) * 1e3) for t, origin in zip(timelines, origins, strict=True)]


def gather_timeline(
    timeline: RankTimeline,
    schedule: Schedule,
    *,
    group: dist.ProcessGroup | None = None,
) -> SimResult | None:
    """Collect every rank's timeline on rank 0 of ``group`` (a collective call).

    Returns, on rank 0 only, the measured step as a SimResult of ``schedule`` (the
    schedule the ranks executed; each rank's actions as it ran them, so an FB run as its
    two halves one after the other holds those halves: the planner's exports write it as
    a Chrome trace or a picture); other ranks get None.
    """
    timeline.resolve()
    is_root = dist.get_rank(group) == 0
    gathered: list[RankTimeline] | None = [None] * dist.get_world_size(group) if is_root else None
    dist.gather_object(timeline, gathered, group=group, group_dst=0)
    if gathered is None:
        return None
    ranks = sorted(aligned_timelines(gathered), key=lambda t: t.rank)
    sent = {key: (t.rank, at) for t in ranks for key, _, at in t.sent}
    messages = [
        Message(key[0], key[1], key[2], src, t.rank, sent[key][1], at)
        for t in ranks
        for key, src, at in t.received
        if key in sent
    ]
    makespan = max((a.end for t in ranks for a in t.actions), default=0.0)
    stats = [
        RankStats(
            t.rank,
            t.actions,
            sum(a.end - a.start for a in t.actions),
            t.peak_activations,
            makespan,
        )
        for t in ranks
    ]
    return SimResult(schedule, _fitted_cost(ranks), makespan, stats, messages)
