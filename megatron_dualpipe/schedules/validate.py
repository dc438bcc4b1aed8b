"""The validator: a schedule is complete, respects its data dependencies, matches every
send with a receive in the same order on each channel, and completes in a dry run (under
gloo's rules, where a send never blocks its sender; with ``backend="nccl"`` its
communication plan must also finish under NCCL's in the worst case, see :mod:`.nccl_rules`).

Every failure raises :class:`ScheduleError` naming the rank, the action and what is unmet.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from .comm_plan import comm_plan
from .cost import CostModel
from .ir import COMM_KINDS, COMPUTE_KINDS, Action, Kind, Placement, Schedule, ScheduleError
from .lowering import channel_of, lower, message_key
from .nccl_rules import EAGER_LIMIT, Streams, check_nccl
from .simulate import simulate
from .step_collectives import COLLECTIVES

__all__ = ["BACKENDS", "check", "check_weight_grads_in_b_order", "validate"]


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
        prev_remote, next_remote = p.remote_neighbours(s)
        prev.append(None if prev_remote else p.prev_stage(s))
        nxt.append(None if next_remote else p.next_stage(s))
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
    prev_remote, next_remote = p.remote_neighbours(half.stage)
    if half.kind is Kind.W or not (prev_remote if half.kind is Kind.F else next_remote):
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


# --------------------------------------------------------------------------------------
# Compute-only schedules, in time and memory linear in their actions.
#
# One pass per rank writes each action's position into per (kind, stage) rows indexed by
# micro-batch, and appends the messages the lowering pass would make its sends and
# receives to per-channel arrays of ints, without building the lowered schedule. A sweep
# over the rows then finds any fault the checks above would report (and those checks,
# run on a faulty schedule only, name it); the channels' arrays must list the same
# messages in the same order on both ends.

Channels = dict[tuple[int, int, str], array]


def _rank_is_sound(
    rank: int, actions: list[Action], p: Placement, sent: Channels, received: Channels
) -> bool:
    """Whether rank ``rank``'s actions pass :func:`_check_placement`, :func:`_check_order`
    and :func:`_check_complete` (False: run those to name the fault); appends the messages
    its lowered form would send and receive to ``sent`` and ``received``."""
    M, S = p.num_microbatches, p.num_stages
    stages = [p.stage_of(rank, c) for c in range(p.num_chunks)]
    # rows[k][stage]: (chunk, position of each micro-batch's action of kind k or -1,
    # channel of its receive, message base, channel of its send, message base)
    rows: list[dict[int, tuple]] = [{}, {}, {}, {}]
    for c, s in enumerate(stages):
        prev, nxt = p.prev_stage(s), p.next_stage(s)
        prev_rank = rank if prev is None else p.rank_of(prev)
        next_rank = rank if nxt is None else p.rank_of(nxt)
        forward_in = forward_out = backward_in = backward_out = (None, -1)
        if prev_rank != rank:
            forward_in = (received[(prev_rank, rank, "F")], s * M)
            backward_out = (sent[(rank, prev_rank, "B")], (S + prev) * M)
        if next_rank != rank:
            forward_out = (sent[(rank, next_rank, "F")], nxt * M)
            backward_in = (received[(next_rank, rank, "B")], (S + s) * M)
        rows[0][s] = (c, [-1] * M, *forward_in, *forward_out)
        rows[1][s] = (c, [-1] * M, *backward_in, *backward_out)
        rows[2][s] = (c, [-1] * M, None, -1, None, -1)
        rows[3][s] = (c, [-1] * M, *backward_in, *backward_out)
    f_rows, b_rows, w_rows, bw_rows = rows
    F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW
    i = 0
    try:
        for action in actions:
            for half in action[4] or (action,):
                kind, s, m = half[0], half[1], half[2]
                if kind is F:
                    found = f_rows.get(s)
                elif kind is B:
                    found = b_rows.get(s)
                elif kind is W:
                    found = w_rows.get(s)
                elif kind is BW:
                    found = bw_rows.get(s)
                else:
                    return False
                if found is None or found[0] != half[3] or m < 0 or found[1][m] >= 0:
                    return False
                found[1][m] = i
                i += 1
                if found[2] is not None:
                    found[2].append(found[3] + m)
                if found[4] is not None:
                    found[4].append(found[5] + m)
    except IndexError:  # a micro-batch beyond the last
        return False
    half_m = M // 2
    for s in stages:
        f, b, w, bw = (kind_rows[s][1] for kind_rows in rows)
        lo, hi = 0, M
        if p.kind == "mirror":
            lo, hi = (0, half_m) if s < p.num_ranks else (half_m, M)
            if any(x >= 0 for row in (f, b, w, bw) for x in (*row[:lo], *row[hi:])):
                return False
        prev, nxt = p.prev_stage(s), p.next_stage(s)
        fp = f_rows[prev][1] if prev in f_rows else None
        nb, nbw = (b_rows[nxt][1], bw_rows[nxt][1]) if nxt in b_rows else (None, None)
        for m in range(lo, hi):
            fm, bm, wm, bwm = f[m], b[m], w[m], bw[m]
            if fm < 0 or (bwm >= 0) == (bm >= 0) or (bm >= 0) != (wm >= 0):
                return False
            dx = bm if bm >= 0 else bwm
            if dx < fm or (wm >= 0 and wm < bm):
                return False
            if fp is not None and not 0 <= fp[m] < fm:
                return False
            if nb is not None:
                next_dx = nb[m] if nb[m] >= 0 else nbw[m]
                if not 0 <= next_dx < dx:
                    return False
    return True


def _check_compute_only(schedule: Schedule, progress: Callable[[int], None] | None) -> None:
    """Placement, completeness, local order and channel order of a compute-only schedule
    (what the checks above find in it and in ``lower(schedule)``), in linear time;
    ``progress`` gets the number of ranks checked."""
    p = schedule.placement
    sent: Channels = defaultdict(lambda: array("q"))
    received: Channels = defaultdict(lambda: array("q"))
    sound = len(schedule.ranks) == p.num_ranks
    for rank, actions in enumerate(schedule.ranks):
        sound = sound and _rank_is_sound(rank, actions, p, sent, received)
        if progress is not None:
            progress(rank + 1)
    if not sound:  # name the fault, the slow way
        _check_placement(schedule)
        _check_complete_and_local_order(schedule)
        _check_communication(lower(schedule))
        return
    S, M = p.num_stages, p.num_microbatches
    for channel in sorted(sent.keys() | received.keys()):
        out, into = sent[channel], received[channel]
        if out == into:
            continue
        src, dst, direction = channel
        i = next((i for i, (a, b) in enumerate(zip(out, into)) if a != b), None)  # noqa: B905
        if i is None:  # same order, different counts: the completeness checks rule it out
            raise ScheduleError(
                f"rank {src} -> rank {dst} ({direction}): {len(out)} messages sent, "
                f"{len(into)} received"
            )
        a, b = (_message_text(key, S, M) for key in (out[i], into[i]))
        raise ScheduleError(
            f"rank {src} -> rank {dst} ({direction}): message {i} is sent for {a} but "
            f"received as {b}: the two ranks must agree on the order (NCCL matches by order)"
        )


def _message_text(key: int, S: int, M: int) -> str:
    """``1RECV_F5``: the receive that consumes message ``key``."""
    stage, mb = divmod(key, M)
    kind = Kind.RECV_F if stage < S else Kind.RECV_B
    return f"{stage % S}{kind.value}{mb}"


def check(
    schedule: Schedule, *, dry_run: bool = True, progress: Callable[[int], None] | None = None
) -> None:
    """Check ``schedule``; raise ScheduleError on any fault. Linear in the number of
    actions for a compute-only schedule (a lowered one is checked action by action), and
    then ``progress`` is called with the number of ranks checked so far.

    ``dry_run=False`` skips the deadlock check, for callers about to :func:`simulate` the
    schedule anyway (the simulation raises the same DeadlockError)."""
    if schedule.is_lowered:
        _check_placement(schedule)
        _check_complete_and_local_order(schedule.compute_only())
        _check_same_messages(schedule)
        _check_communication(schedule)
    else:
        _check_compute_only(schedule, progress)
    if dry_run:
        simulate(schedule, CostModel(), timeline=False)  # raises DeadlockError, naming ranks


def check_weight_grads_in_b_order(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` where a stage's W actions do not run in the order of its
    B actions, as a first-in first-out store of deferred weight gradients needs."""
    ordered = schedule.with_weight_grads_in_b_order()
    for rank, (actions, wanted) in enumerate(zip(schedule.ranks, ordered.ranks, strict=True)):
        for action, expected in zip(actions, wanted, strict=True):
            if action != expected:
                raise ScheduleError(
                    f"rank {rank}: {action} runs where the weight gradient of {expected} is "
                    "due: each stage's W must follow its B order (deferred weight gradients "
                    "run first-in first-out); reorder them, e.g. with "
                    "Schedule.with_weight_grads_in_b_order()"
                )


BACKENDS = ("gloo", "nccl")


def validate(
    schedule: Schedule,
    *,
    dry_run: bool = True,
    backend: str = "gloo",
    eager_limit: int = EAGER_LIMIT,
    streams: Streams = "shared",
    collectives: Sequence[str] = COLLECTIVES,
    **plan_options: Any,
) -> Schedule:
    """:func:`check` ``schedule`` and return its lowered form.

    ``backend="gloo"`` checks under gloo's rules (a send never blocks its sender);
    ``backend="nccl"`` also runs its communication plan (:func:`~.comm_plan.comm_plan`
    with ``plan_options``) under NCCL's
    (:func:`~.nccl_rules.check_nccl`: by default the worst case, every communicator of a
    rank on one stream with the step's data- and expert-parallel ``collectives`` on it;
    sends above ``eager_limit`` bytes rendezvous) and raises
    :class:`~.nccl_rules.CommDeadlockError` naming the cycle where it cannot finish.
    """
    if backend not in BACKENDS:
        raise ScheduleError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    check(schedule, dry_run=dry_run)
    lowered = schedule if schedule.is_lowered else lower(schedule)
    if backend == "nccl":
        plan = comm_plan(lowered, **plan_options)
        check_nccl(
            plan, streams=streams, collectives=collectives, eager_limit=eager_limit, bound=False
        )
    return lowered
