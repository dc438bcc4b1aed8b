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
    """Every action names a stage of its own rank, with that stage's chunk, and a
    micro-batch that passes that stage."""
    p = schedule.placement
    if len(schedule.ranks) != p.num_ranks:
        raise ScheduleError(
            f"the schedule lists {len(schedule.ranks)} ranks, its placement {p.num_ranks}"
        )
    where = [(p.rank_of(s), p.chunk_of(s)) for s in range(p.num_stages)]
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            for half in action.sub or (action,):
                stage, mb = half.stage, half.microbatch
                p.check_stage(stage)
                owner, chunk = where[stage]
                if owner != rank:
                    raise ScheduleError(
                        f"rank {rank}: {half} runs stage {stage}, which lives on rank {owner}"
                    )
                if half.chunk != chunk:
                    raise ScheduleError(
                        f"rank {rank}: {half} names chunk {half.chunk}, stage {stage} is "
                        f"chunk {chunk}"
                    )
                if not 0 <= mb < p.num_microbatches:
                    raise ScheduleError(f"rank {rank}: {half} names a micro-batch out of range")
                if half.kind in COMPUTE_PLAIN and stage not in p.path(mb):
                    raise ScheduleError(
                        f"rank {rank}: {half}: micro-batch {mb} does not pass stage {stage}"
                    )


COMPUTE_PLAIN = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW})


def _local_neighbours(p: Placement) -> tuple[list[int | None], list[int | None]]:
    """Per stage: its previous and next stage where that lives on the same rank, else None."""
    prev, nxt = [], []
    for s in range(p.num_stages):
        a, b = p.prev_stage(s), p.next_stage(s)
        prev.append(a if a is not None and p.rank_of(a) == p.rank_of(s) else None)
        nxt.append(b if b is not None and p.rank_of(b) == p.rank_of(s) else None)
    return prev, nxt


def _check_order(rank: int, actions: list[Action], p: Placement) -> set[tuple[Kind, int, int]]:
    """Local dependencies in execution order; returns the (kind, stage, mb) seen."""
    local_prev, local_next = _local_neighbours(p)
    seen: set[tuple[Kind, int, int]] = set()
    for action in actions:
        for half in action.computes:
            kind, s, m = half.kind, half.stage, half.microbatch
            if kind not in COMPUTE_PLAIN:
                continue
            if (kind, s, m) in seen:
                raise ScheduleError(f"rank {rank}: {half} appears twice")
            needs: list[tuple[Kind, int, int, str]] = []
            if kind is Kind.F:
                if local_prev[s] is not None:
                    needs.append((Kind.F, local_prev[s], m, "the forward of the previous stage"))
            else:
                needs.append((Kind.F, s, m, "its forward"))
            if (kind is Kind.B or kind is Kind.BW) and local_next[s] is not None:
                n = local_next[s]
                dx = (Kind.B, n, m) if (Kind.B, n, m) in seen else (Kind.BW, n, m)
                needs.append((*dx, "the input gradient of the next stage"))
            if kind is Kind.W:
                needs.append((Kind.B, s, m, "its input-gradient pass B"))
            for need_kind, stage, mb, what in needs:
                if (need_kind, stage, mb) not in seen:
                    raise ScheduleError(
                        f"rank {rank}: {half} runs before {what} ({Action(need_kind, stage, mb)})"
                    )
            seen.add((kind, s, m))
    return seen


def _check_complete(rank: int, seen: set[tuple[Kind, int, int]], p: Placement) -> None:
    """Every (stage, micro-batch) of this rank has its F and one BW or a B with its W."""
    for chunk in range(p.num_chunks):
        s = p.stage_of(rank, chunk)
        for m in range(p.num_microbatches):
            if s not in p.path(m):
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


def _check_complete_and_local_order(schedule: Schedule) -> None:
    """Each (stage, micro-batch) once: F, then B then W (or BW); same-rank neighbours in order."""
    p = schedule.placement
    for rank, actions in enumerate(schedule.ranks):
        _check_complete(rank, _check_order(rank, actions, p), p)


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
    remote_input: dict[tuple[Kind, int], Kind | None] = {}
    routes: dict[tuple[Kind, int], tuple[tuple, Kind, int | None]] = {}
    for rank, actions in enumerate(lowered.ranks):
        done: set[tuple[Kind, int, int]] = set()
        for action in actions:
            kind, stage, mb = action.kind, action.stage, action.microbatch
            if kind in COMPUTE_KINDS:
                for half in action.sub or (action,):
                    where = (half.kind, half.stage)
                    if where not in remote_input:
                        remote_input[where] = _remote_input(p, half)
                    recv = remote_input[where]
                    if recv is not None and (recv, half.stage, half.microbatch) not in done:
                        raise ScheduleError(
                            f"rank {rank}: {half} runs before its receive "
                            f"{Action(recv, half.stage, half.microbatch)}"
                        )
                    done.add((half.kind, half.stage, half.microbatch))
                continue
            if (kind, stage) not in routes:
                key = message_key(action, p)
                routes[(kind, stage)] = (channel_of(action, rank, p), key[0], key[1])
            channel, key_kind, key_stage = routes[(kind, stage)]
            if kind is Kind.SEND_F or kind is Kind.SEND_B:
                made = (
                    (Kind.F, stage, mb) in done
                    if kind is Kind.SEND_F
                    else ((Kind.B, stage, mb) in done or (Kind.BW, stage, mb) in done)
                )
                if not made:
                    raise ScheduleError(f"rank {rank}: {action} is sent before it is computed")
                sent[channel].append((key_kind, key_stage, mb))
            else:
                done.add((kind, stage, mb))
                received[channel].append((key_kind, key_stage, mb))
    for channel, out in sent.items():
        src, dst, direction = channel
        for i, (a, b) in enumerate(zip(out, received[channel], strict=True)):
            if a != b:
                raise ScheduleError(
                    f"rank {src} -> rank {dst} ({direction}): message {i} is sent for "
                    f"{a[1]}{a[0].value}{a[2]} but received as {b[1]}{b[0].value}{b[2]}: the "
                    "two ranks must agree on the order (NCCL matches by order)"
                )


def validate(schedule: Schedule, *, dry_run: bool = True) -> Schedule:
    """Check ``schedule`` and return its lowered form; raise ScheduleError on any fault.

    ``dry_run=False`` skips the deadlock check, for callers about to :func:`simulate` the
    schedule anyway (the simulation raises the same DeadlockError)."""
    _check_placement(schedule)
    _check_complete_and_local_order(schedule.compute_only())
    if schedule.is_lowered:
        _check_same_messages(schedule)
    lowered = schedule if schedule.is_lowered else lower(schedule)
    _check_communication(lowered)
    if dry_run:
        simulate(schedule, CostModel())  # raises DeadlockError naming the waiting ranks
    return lowered
