"""Point-to-point latency between two ranks of a process group, measured by ping-pong."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["p2p_latency_s"]


def p2p_latency_s(
    group: dist.ProcessGroup | None = None, *, rounds: int = 20, device: str | None = None
) -> float:
    """One-way latency (s) of a small message between ranks 0 and 1 of ``group``: the
    median of ``rounds`` round trips (after two untimed ones), halved; the same value on
    every rank of the group (0.0 in a group of one). Collective over ``group``."""
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    device = device or ("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    result = torch.zeros(1, dtype=torch.float64, device=device)
    if size > 1 and rank < 2:
        peer = dist.get_global_rank(group, 1 - rank) if group is not None else 1 - rank
        ball = torch.zeros(1, device=device)
        trips = []
        for k in range(rounds + 2):
            start = time.perf_counter()
            if rank == 0:
                dist.send(ball, peer, group=group)
                dist.recv(ball, peer, group=group)
            else:
                dist.recv(ball, peer, group=group)
                dist.send(ball, peer, group=group)
            if device != "cpu":
                torch.cuda.synchronize()
            if k >= 2:
                trips.append(time.perf_counter() - start)
        if rank == 0:
            result[0] = statistics.median(trips) / 2
    if size > 1:
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(result, src, group=group)
    return float(result[0])
