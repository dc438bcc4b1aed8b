"""The lowering pass: insert the sends and receives a compute-only schedule implies.

Semantics the runtime honours: a send is asynchronous (the sender goes on at once); a
receive blocks until its message has arrived. Every receive is placed right before the
compute that consumes it and every send right after the compute that produces it, so the
lowered schedule deadlocks exactly when the compute order has a cycle, which the
validator reports. Messages travel on separate channels per (sender, receiver, direction):
forward activations and backward gradients between the same two ranks never share a
queue (at PP=2 the previous and next rank are the same rank).
"""

from __future__ import annotations

from functools import partial

from .ir import COMM_KINDS, Action, Kind, Placement, Schedule

__all__ = ["lower", "message_key", "peer_of", "Channel"]

#: A message's identity: the receive action that consumes it (kind, stage, micro-batch).
MessageKey = tuple[Kind, int, int]
#: A channel: (sender rank, receiver rank, "F" or "B").
Channel = tuple[int, int, str]


def message_key(action: Action, placement: Placement) -> MessageKey:
    """The key shared by a send and the receive that matches it."""
    if action.kind is Kind.SEND_F:
        return (Kind.RECV_F, placement.next_stage(action.stage), action.microbatch)
    if action.kind is Kind.SEND_B:
        return (Kind.RECV_B, placement.prev_stage(action.stage), action.microbatch)
    return (action.kind, action.stage, action.microbatch)


def peer_of(action: Action, placement: Placement) -> int:
    """The rank a communication action talks to."""
    if action.kind in (Kind.SEND_F, Kind.RECV_B):
        return placement.rank_of(placement.next_stage(action.stage))
    return placement.rank_of(placement.prev_stage(action.stage))


def channel_of(action: Action, rank: int, placement: Placement) -> Channel:
    peer = peer_of(action, placement)
    direction = "F" if action.kind in (Kind.SEND_F, Kind.RECV_F) else "B"
    if action.kind in (Kind.SEND_F, Kind.SEND_B):
        return (rank, peer, direction)
    return (peer, rank, direction)


# Actions built without NamedTuple's Python-level __new__: lowering makes ~10^5 of them.
_new_action = partial(tuple.__new__, Action)


def lower(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with its communication inserted (compute order unchanged)."""
    p = schedule.placement
    remote = [p.remote_neighbours(s) for s in range(p.num_stages)]
    prev_remote, next_remote = [r[0] for r in remote], [r[1] for r in remote]
    ranks = []
    for actions in schedule.ranks:
        lowered: list[Action] = []
        for action in actions:
            if action.kind in COMM_KINDS:
                continue
            before: list[Action] = []
            after: list[Action] = []
            for half in action.computes:
                s, m, c = half.stage, half.microbatch, half.chunk
                if half.kind is Kind.F:
                    if prev_remote[s]:
                        before.append(_new_action((Kind.RECV_F, s, m, c, ())))
                    if next_remote[s]:
                        after.append(_new_action((Kind.SEND_F, s, m, c, ())))
                elif half.kind is not Kind.W:
                    if next_remote[s]:
                        before.append(_new_action((Kind.RECV_B, s, m, c, ())))
                    if prev_remote[s]:
                        after.append(_new_action((Kind.SEND_B, s, m, c, ())))
            lowered += before
            lowered.append(action)
            lowered += after
        ranks.append(lowered)
    return Schedule(schedule.name, schedule.placement, ranks, schedule.activation_bound)
