"""NCCL's device memory per communicator and per rank: an *estimate* from NCCL's buffer
rules, not a measurement. Pure Python.

Counts the connection buffers of the one communicator our plan uses on a rank, the
pipeline group's: per peer the schedule exchanges messages with (and, under dualpipe, the
mirror partner where it is not already a peer), per channel and direction, each protocol's
buffer rounded up to CUDA's IPC granularity, with NCCL's sizes and channel counts read from
the environment. Megatron-Core's other groups and NCCL's fixed structures are not counted.
The rules and what is left out: docs/memory.md, "NCCL buffers per communicator".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..schedules.ir import COMM_KINDS, Schedule, ScheduleError
from ..schedules.lowering import lower, peer_of

__all__ = [
    "CommMemory",
    "NcclBuffers",
    "nccl_memory",
]

KIB, MIB = 2**10, 2**20
#: NCCL's LL buffer by default: 8 lines per thread x 512 threads x 8 steps x 16 bytes.
LL_BYTES = 8 * 512 * 8 * 16
#: NCCL's LL128 buffer by default: 120 elements per thread x 640 threads x 8 steps x 8 bytes.
LL128_BYTES = 120 * 640 * 8 * 8


def _round_up(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity


@dataclass(frozen=True)
class NcclBuffers:
    """The buffer rules the estimate applies: each protocol's buffer per receive
    connection, point-to-point channels per peer, the allocation granularity, and whether
    connections are made at first use (``NCCL_RUNTIME_CONNECT``)."""

    simple: int = 4 * MIB
    ll: int = LL_BYTES
    ll128: int = LL128_BYTES
    channels_per_peer: int = 2
    granularity: int = 2 * MIB
    runtime_connect: bool = True

    def __post_init__(self) -> None:
        for name in ("simple", "ll", "ll128", "channels_per_peer", "granularity"):
            value = getattr(self, name)
            if value < 1:
                raise ScheduleError(f"NCCL buffers: {name} must be at least 1, got {value}")

    @staticmethod
    def from_env(env: Mapping[str, str]) -> NcclBuffers:
        """The rules under NCCL's environment variables in ``env`` (``NCCL_BUFFSIZE``,
        ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE``, ``NCCL_NCHANNELS_PER_NET_PEER``
        capped by ``NCCL_MAX_P2P_NCHANNELS`` and rounded up to a power of two as NCCL does,
        ``NCCL_RUNTIME_CONNECT``); unset ones keep NCCL's defaults."""

        def number(name: str, default: int) -> int:
            text = env.get(name)
            if text is None or text.strip() == "":
                return default
            try:
                value = int(text)
            except ValueError:
                raise ScheduleError(
                    f"{name}={text!r} is not a whole number: set it to one or unset it"
                ) from None
            if value < (0 if name == "NCCL_RUNTIME_CONNECT" else 1):
                raise ScheduleError(f"{name}={text!r} is out of range: set a positive number")
            return value

        base = NcclBuffers()
        channels = number("NCCL_NCHANNELS_PER_NET_PEER", base.channels_per_peer)
        channels = min(channels, number("NCCL_MAX_P2P_NCHANNELS", channels))
        return NcclBuffers(
            simple=number("NCCL_BUFFSIZE", base.simple),
            ll=number("NCCL_LL_BUFFSIZE", base.ll),
            ll128=number("NCCL_LL128_BUFFSIZE", base.ll128),
            channels_per_peer=1 << (channels - 1).bit_length(),
            runtime_connect=number("NCCL_RUNTIME_CONNECT", 1) != 0,
        )

    @property
    def receive_bytes(self) -> int:
        """One receive connection: a buffer per protocol, rounded up."""
        return _round_up(self.simple + self.ll + self.ll128, self.granularity)

    @property
    def send_bytes(self) -> int:
        """One send connection: its control block, rounded up."""
        return self.granularity

    def peer_bytes(self, peers: int) -> int:
        """What ``peers`` peers connected both ways hold on this rank."""
        return peers * self.channels_per_peer * (self.send_bytes + self.receive_bytes)

    def describe(self) -> str:
        """One phrase: the rules in use."""
        connect = (
            "connections made at first use (NCCL_RUNTIME_CONNECT=1, NCCL 2.22+)"
            if self.runtime_connect
            else "NCCL_RUNTIME_CONNECT=0: collective connections made at creation, not counted"
        )
        return (
            f"per connection buffers of {_mib(self.simple)} MiB Simple, {_mib(self.ll)} MiB LL, "
            f"{_mib(self.ll128)} MiB LL128 (a receive {_mib(self.receive_bytes)} MiB, a send "
            f"{_mib(self.send_bytes)} MiB, rounded up to {_mib(self.granularity)} MiB), "
            f"{self.channels_per_peer} channels per peer, {connect}"
        )


def _mib(n: float) -> str:
    return f"{n / MIB:.3g}"


@dataclass(frozen=True)
class CommMemory:
    """One communicator on one rank: its name, its member ranks, the peers this rank is
    connected to (both ways) and the estimated bytes of their buffers on this rank."""

    rank: int
    comm: str
    members: tuple[int, ...]
    peers: tuple[int, ...]
    bytes: int


def _pipeline_peers(schedule: Schedule) -> list[tuple[int, ...]]:
    """Per rank, the ranks its schedule sends to or receives from."""
    lowered = schedule if schedule.is_lowered else lower(schedule)
    p = lowered.placement
    return [
        tuple(sorted({peer_of(a, p) for a in actions if a.kind in COMM_KINDS}))
        for actions in lowered.ranks
    ]


def nccl_memory(schedule: Schedule, buffers: NcclBuffers | None = None) -> list[list[CommMemory]]:
    """Per rank, the estimate of the pipeline communicator's connections: the schedule's
    peers (``pipeline``), then dualpipe's mirror partner where it is no such peer
    (``mirror``, on the same communicator); a rank without peers has none."""
    rules = buffers or NcclBuffers()
    p = schedule.placement
    members = tuple(range(p.num_ranks))
    out = []
    for rank, peers in enumerate(_pipeline_peers(schedule)):
        comms = []
        if peers:
            comms.append(CommMemory(rank, "pipeline", members, peers, rules.peer_bytes(len(peers))))
        partner = p.num_ranks - 1 - rank
        if p.kind == "mirror" and partner != rank and partner not in peers:
            comms.append(CommMemory(rank, "mirror", members, (partner,), rules.peer_bytes(1)))
        out.append(comms)
    return out
