"""The validator: a schedule is complete, respects its data dependencies, matches every
send with a receive in the same order on each channel, and completes in a dry run.

Every failure raises :class:`ScheduleError` naming the rank, the action and what is unmet.
"""

from __future__ import annotations

from collections import defaultdict

from .cost import CostModel
from .ir import COMM_KINDS, COMPUTE_KINDS, Action, Kind, Placement, Schedule, ScheduleError
from .lowering import channel_of, lower, message_key
from .simulate import simulate

__all__ = ["validate"]


def _check_placement(schedule: Schedule) -> None:
    p = schedule.placement
    if len(schedule.ranks) != p.num_ranks:
        raise ScheduleError(
            f"the schedule lists {len(schedule.ranks)} ranks, its placement {p.num_ranks}"
        )
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            for half in action.computes:
                p.check_stage(half.stage)
                if p.rank_of(half.stage) != rank:
                    raise ScheduleError(
                        f"rank {rank}: {half} runs stage {half.stage}, which lives on rank "
                        f"{p.rank_of(half.stage)}"
                    )
                if half.chunk != p.chunk_of(half.stage):
                    raise ScheduleError(
                        f"rank {rank}: {half} names chunk {half.chunk}, stage {half.stage} is "
                        f"chunk {p.chunk_of(half.stage)}"
                    )
                if not 0 <= half.microbatch < p.num_microbatches:
                    raise ScheduleError(f"rank {rank}: {half} names a micro-batch out of range")
                if half.kind in COMPUTE_PLAIN and half.stage not in p.path(half.microbatch):
                    raise ScheduleError(
                        f"rank {rank}: {half}: micro-batch {half.microbatch} does not pass "
                        f"stage {half.stage}"
                    )


COMPUTE_PLAIN = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW})


def _check_complete_and_local_order(schedule: Schedule) -> None:
    """Each (stage, micro-batch) once: F, then B then W (or BW); same-rank neighbours in order."""
    p = schedule.placement
    for rank, actions in enumerate(schedule.ranks):
        seen: dict[tuple[Kind, int, int], int] = {}
        position = 0
        for action in actions:
            for half in action.computes:
                if half.kind not in COMPUTE_PLAIN:
                    continue
                key = (half.kind, half.stage, half.microbatch)
                if key in seen:
                    raise ScheduleError(f"rank {rank}: {half} appears twice")
                s, m = half.stage, half.microbatch
                needs: list[tuple[Kind, int, int, str]] = []
                if half.kind is Kind.F:
                    prev = p.prev_stage(s)
                    if prev is not None and p.rank_of(prev) == rank:
                        needs.append((Kind.F, prev, m, "the forward of the previous stage"))
                else:
                    needs.append((Kind.F, s, m, "its forward"))
                if half.kind in (Kind.B, Kind.BW):
                    nxt = p.next_stage(s)
                    if nxt is not None and p.rank_of(nxt) == rank:
                        dx = (Kind.B, nxt, m) if (Kind.B, nxt, m) in seen else (Kind.BW, nxt, m)
                        needs.append((*dx, "the input gradient of the next stage"))
                if half.kind is Kind.W:
                    needs.append((Kind.B, s, m, "its input-gradient pass B"))
                for kind, stage, mb, what in needs:
                    if (kind, stage, mb) not in seen:
                        raise ScheduleError(
                            f"rank {rank}: {half} runs before {what} "
                            f"({Action(kind, stage, mb)})"
                        )
                seen[key] = position
                position += 1
        for m in range(p.num_microbatches):
            for s in p.path(m):
                if p.rank_of(s) != rank:
                    continue
                if (Kind.F, s, m) not in seen:
                    raise ScheduleError(f"rank {rank}: missing the forward {s}F{m}")
                has_bw = (Kind.BW, s, m) in seen
                has_b, has_w = (Kind.B, s, m) in seen, (Kind.W, s, m) in seen
                if has_bw and (has_b or has_w):
                    raise ScheduleError(f"rank {rank}: {s}BW{m} and a split {s}B{m}/{s}W{m} both")
                if not has_bw and not has_b:
                    raise ScheduleError(f"rank {rank}: missing the backward of {s}F{m}")
                if has_b and not has_w:
                    raise ScheduleError(f"rank {rank}: {s}B{m} has no matching {s}W{m} (missing W)")
                if has_w and not has_b:
                    raise ScheduleError(f"rank {rank}: {s}W{m} has no {s}B{m} before it")


def _remote_input(p: Placement, half: Action) -> Kind | None:
    """The receive a compute action needs first, if its input comes from another rank."""
    s = half.stage
    other = p.prev_stage(s) if half.kind is Kind.F else p.next_stage(s)
    if half.kind in (Kind.W,) or other is None or p.rank_of(other) == p.rank_of(s):
        return None
    return Kind.RECV_F if half.kind is Kind.F else Kind.RECV_B


def _check_same_messages(lowered: Schedule) -> None:
    """A hand-lowered schedule has exactly the sends and receives its compute order needs."""
    expected = lower(lowered.compute_only())
    for rank, (actions, wanted) in enumerate(zip(lowered.ranks, expected.ranks, strict=True)):
        have = {a for a in actions if a.kind in COMM_KINDS}
        need = {a for a in wanted if a.kind in COMM_KINDS}
        if need - have:
            missing = min(need - have)
            raise ScheduleError(f"rank {rank}: {missing} is missing: its peer's message is lost")
        if have - need:
            extra = min(have - need)
            raise ScheduleError(f"rank {rank}: {extra} has no counterpart in the compute order")


def _check_communication(lowered: Schedule) -> None:
    """Each cross-rank dependency has its receive before the consumer and its send after the
    producer; sends and receives pair up in the same order on every channel."""
    p = lowered.placement
    sent: dict[tuple, list] = defaultdict(list)
    received: dict[tuple, list] = defaultdict(list)
    for rank, actions in enumerate(lowered.ranks):
        done: set[tuple[Kind, int, int]] = set()
        for action in actions:
            for half in action.computes if action.kind in COMPUTE_KINDS else ():
                recv = _remote_input(p, half)
                if recv is not None and (recv, half.stage, half.microbatch) not in done:
                    raise ScheduleError(
                        f"rank {rank}: {half} runs before its receive "
                        f"{Action(recv, half.stage, half.microbatch)}"
                    )
                done.add((half.kind, half.stage, half.microbatch))
            if action.kind in (Kind.SEND_F, Kind.SEND_B):
                producers = (Kind.F,) if action.kind is Kind.SEND_F else (Kind.B, Kind.BW)
                if not any((k, action.stage, action.microbatch) in done for k in producers):
                    raise ScheduleError(f"rank {rank}: {action} is sent before it is computed")
                sent[channel_of(action, rank, p)].append(message_key(action, p))
            elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                done.add((action.kind, action.stage, action.microbatch))
                received[channel_of(action, rank, p)].append(message_key(action, p))
    for channel, out in sent.items():
        src, dst, direction = channel
        for i, (a, b) in enumerate(zip(out, received[channel], strict=True)):
            if a != b:
                raise ScheduleError(
                    f"rank {src} -> rank {dst} ({direction}): message {i} is sent for "
                    f"{a[1]}{a[0].value}{a[2]} but received as {b[1]}{b[0].value}{b[2]}: the "
                    "two ranks must agree on the order (NCCL matches by order)"
                )


def validate(schedule: Schedule) -> Schedule:
    """Check ``schedule`` and return its lowered form; raise ScheduleError on any fault."""
    _check_placement(schedule)
    _check_complete_and_local_order(schedule.compute_only())
    if schedule.is_lowered:
        _check_same_messages(schedule)
    lowered = schedule if schedule.is_lowered else lower(schedule)
    _check_communication(lowered)
    simulate(schedule, CostModel())  # the dry run: raises DeadlockError naming waiting ranks
    return lowered
