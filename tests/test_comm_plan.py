"""The communication plan and the model of NCCL's ordering rules (pure Python).

- The shipped lock-step plan (one pipeline communicator, one batch per exchange point,
  waited before the next compute) finishes under NCCL's rules in the worst case (every
  communicator of a rank and the step's data- and expert-parallel collectives on one
  stream, every send waiting for its receive) for every registered schedule at PP 2..16
  and micro-batches 2PP..4PP+2 (and the registry's least where lower), with small
  messages, variable shapes and forward-only steps too.
- Its exchange points hold the premise of that proof: each message's round lies between
  its producer and its consumer, and every rank meets the rounds in one order.
- The model's rules, each on a hand-made plan: rendezvous and eager sends, in-order
  matching (a mismatch is named), lazy set-up in different orders (a cycle), waits for a
  whole batch, streams shared or not (two-rank channels queued behind each other, a
  collective behind a pipeline receive: each cycle named).
- The in-flight bound of sends, on a plan whose answer is known.
"""

from __future__ import annotations

import itertools

import pytest

from megatron_dualpipe.schedules.comm_plan import (
    Comm,
    CommOp,
    CommPlan,
    Compute,
    Init,
    Issue,
    Wait,
    comm_plan,
    pipeline_comm,
)
from megatron_dualpipe.schedules.exchange import exchange_points
from megatron_dualpipe.schedules.ir import Kind, Placement, Schedule, ScheduleError
from megatron_dualpipe.schedules.nccl_rules import CommDeadlockError, check_nccl, inflight_bound
from megatron_dualpipe.schedules.registry import SCHEDULES, generate, spec
from megatron_dualpipe.schedules.simulate import simulate
from megatron_dualpipe.schedules.validate import validate

LARGE, SMALL = 2**30, 1024


def _microbatches(name: str, pp: int) -> list[int]:
    """The legal micro-batch counts of ``name`` at ``pp`` from 2 PP (or the registry's
    least, where lower) to 4 PP + 2."""
    s = spec(name)
    least = min(2 * pp, s.min_microbatches(pp))
    return [m for m in range(least, 4 * pp + 3) if s.problem(pp, m) is None]


def _legal(name: str, pp: int) -> bool:
    return spec(name).problem(pp, spec(name).min_microbatches(pp)) is None  # dualpipe: even PP


FAST = [(n, pp) for n, pp in itertools.product(SCHEDULES, (2, 3, 4)) if _legal(n, pp)]
FULL = [
    (n, pp)
    for n, pp in itertools.product(SCHEDULES, range(2, 17))
    if _legal(n, pp) and (n, pp) not in FAST
]
#: (variable shapes, forward-only, message size) of the worst-case check.
VARIANTS = [(v, f, size) for v in (False, True) for f in (False, True) for size in (LARGE, SMALL)]


@pytest.mark.parametrize(
    ("name", "pp"), [*FAST, *(pytest.param(*c, marks=pytest.mark.slow) for c in FULL)]
)
def test_the_lock_step_plan_finishes_in_the_worst_case(name: str, pp: int) -> None:
    """``validate(backend="nccl")``'s default is the worst case (one stream per rank, the
    collectives on it). With large messages every legal micro-batch count up to PP 4;
    beyond, the three least (where warm-up and cool-down meet), every fourth and the
    largest; at PP 2-4 every variant for each count, beyond at the ends of the range (the
    sweep's time)."""
    counts = _microbatches(name, pp)
    checked = counts if pp <= 4 else sorted({*counts[:3], *counts[::4], counts[-1]})
    for m in checked:
        schedule = generate(name, pp, m)
        validate(schedule, backend="nccl", message_bytes=LARGE, eager_limit=0)
        if pp > 4 and m not in (counts[0], counts[-1]):
            continue
        for variable, forward_only, size in VARIANTS[1:]:  # the same check, plan by plan
            plan = comm_plan(
                schedule,
                message_bytes=None if variable else size,
                variable_shapes=variable,
                forward_only=forward_only,
            )
            check_nccl(plan, eager_limit=0 if size == LARGE else 2 * SMALL, bound=False)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_rank_meets_the_rounds_in_one_order(name: str) -> None:
    """The premise of the proof (schedules/exchange.py): a message's round lies between
    the end of its producer and the start of its consumer in the timeline, its sender
    exchanges it after the producer and its receiver before the consumer, and along every
    rank the rounds of the exchange points never go back."""
    for pp in (2, 3, 4):
        if not _legal(name, pp):
            continue
        schedule = generate(name, pp, _microbatches(name, pp)[-1])
        p = schedule.placement
        points = exchange_points(schedule, schedule.ranks)
        timed = simulate(schedule)
        at = {}  # (kind, stage, micro-batch) -> (index on its rank, its timing)
        for stats in timed.ranks:
            for i, t in enumerate(stats.actions):
                for half in t.action.computes:
                    kind = Kind.B if half.kind is Kind.BW else half.kind
                    at[(kind, half.stage, half.microbatch)] = (i, t)
        ends: dict[tuple, dict[str, tuple[int, float]]] = {}
        for rank, boundaries in enumerate(points):
            seen = [e.round for exchanges in boundaries for e in exchanges]
            assert seen == sorted(seen), f"{name} PP={pp} rank {rank}"
            for b, exchanges in enumerate(boundaries):
                for e in exchanges:
                    ends.setdefault(e.key, {})[e.kind] = (b, e.round)
        for (kind, stage, mb), where in ends.items():
            forward = kind is Kind.RECV_F
            source = p.prev_stage(stage) if forward else p.next_stage(stage)
            made, needed = (Kind.F, Kind.F) if forward else (Kind.B, Kind.B)
            i, producer = at[(made, source, mb)]
            j, consumer = at[(needed, stage, mb)]
            (sent_at, t), (received_at, t2) = where["send"], where["recv"]
            assert t == t2 and producer.end <= t <= consumer.start, (name, pp, kind, stage, mb)
            assert sent_at > i and received_at <= j, (name, pp, kind, stage, mb)


def test_the_deepseek_v3_configuration_passes() -> None:
    """DualPipe over PP=16 with 120 micro-batches, as in DeepSeek-V3's report: one
    communicator, in the worst case."""
    report = check_nccl(comm_plan(generate("dualpipe", 16, 120)), eager_limit=0)
    assert report.comms == [Comm("P", tuple(range(16)), channel=False)]
    assert report.comms_per_rank == [1] * 16
    assert max(report.inflight_bound) <= 2


@pytest.mark.parametrize("variable", [False, True])
def test_a_lock_step_plan_waits_for_each_batch_before_the_next_compute(variable: bool) -> None:
    """One communicator; every Issue is followed by a Wait for all its messages before
    anything else (nothing is pending during a compute); both ends of every message name
    it in the same place of their pair's order (NCCL matches in issue order)."""
    for name in SCHEDULES:
        plan = comm_plan(generate(name, 4, 8), variable_shapes=variable)
        assert plan.comms == [pipeline_comm(plan.schedule.placement)]
        order: dict[tuple[str, int, int], list] = {}
        for rank, steps in enumerate(plan.ranks):
            assert steps[0] == Init(plan.comms[0])
            for step, after in itertools.pairwise(steps):
                if isinstance(step, Issue):
                    assert after == Wait(tuple(op.key for op in step.ops)), f"{name} {rank}"
                    for op in step.ops:
                        pair = (
                            op.kind,
                            *((rank, op.peer) if op.kind == "send" else (op.peer, rank)),
                        )
                        order.setdefault(pair, []).append(op.key)
            assert not isinstance(steps[-1], Issue)
        for (kind, a, b), keys in order.items():
            if kind == "send":
                assert keys == order[("recv", a, b)], f"{name}: {a} -> {b}"


# -- the rules, on hand-made plans -----------------------------------------------------
PLACEMENT = Placement("loop", 2, 2, 2)
F01, F10, B10 = Comm("F", (0, 1)), Comm("F", (1, 0)), Comm("B", (1, 0))
KEY_A, KEY_B = (Kind.RECV_F, 1, 0), (Kind.RECV_F, 1, 1)


def _check(plan: CommPlan, **options) -> None:
    """The hand-made plans give each communicator its stream, unless said otherwise."""
    check_nccl(plan, **{"streams": "distinct", "collectives": (), **options})


def _plan(ranks: list[list], set_up: bool = True) -> CommPlan:
    """A plan of two ranks' steps, with both channels set up first in one order (unless
    not ``set_up``: then each is set up where first used)."""
    schedule = Schedule("hand", PLACEMENT, [[], []])
    if set_up:
        ranks = [[Init(F01), Init(F10), Init(B10), *steps] for steps in ranks]
    return CommPlan(schedule, ranks, False, False)


def _send(key, comm, peer, size=LARGE) -> CommOp:
    return CommOp("send", peer, comm, key, size)


def _recv(key, comm, peer) -> CommOp:
    return CommOp("recv", peer, comm, key)


@pytest.mark.parametrize("size", [LARGE, SMALL])
def test_a_send_waits_for_its_receive_unless_it_is_small(size: int) -> None:
    """Rank 0 waits for its send before rank 1 posts the receive (after its own wait)."""
    plan = _plan(
        [
            [Issue((_send(KEY_A, F01, 1, size),)), Wait((KEY_A,)), Issue((_send(KEY_B, F01, 1),))],
            [
                Wait(()),
                Issue((_recv(KEY_A, F01, 0),)),
                Issue((_recv(KEY_B, F01, 0),)),
                Wait((KEY_A, KEY_B)),
            ],
        ]
    )
    _check(plan)  # a Wait on a send alone never needs the peer's host first
    blocked = _plan(
        [
            [
                Issue((_send(KEY_A, F01, 1, size),)),
                Wait((KEY_A,)),
                Issue((_recv(KEY_B, F10, 1),)),
                Wait((KEY_B,)),
            ],
            [
                Issue((_send(KEY_B, F10, 0, size),)),
                Wait((KEY_B,)),
                Issue((_recv(KEY_A, F01, 0),)),
                Wait((KEY_A,)),
            ],
        ]
    )
    if size == SMALL:
        _check(blocked)
    else:
        with pytest.raises(CommDeadlockError, match="waits for its match from"):
            _check(blocked)


def test_messages_between_two_ranks_match_in_issue_order() -> None:
    plan = _plan(
        [
            [Issue((_send(KEY_A, F01, 1), _send(KEY_B, F01, 1))), Wait((KEY_A, KEY_B))],
            [Issue((_recv(KEY_B, F01, 0), _recv(KEY_A, F01, 0))), Wait((KEY_A, KEY_B))],
        ]
    )
    with pytest.raises(ScheduleError, match="would get the data of rank 0's send of 1RECV_F0"):
        _check(plan)


def test_communicators_set_up_in_different_orders_deadlock() -> None:
    """Setting a communicator up blocks each member until all arrive: explicitly (Init) or
    at its first use, where ranks first use different ones."""
    crossed = _plan([[Init(F01), Init(F10)], [Init(F10), Init(F01)]], set_up=False)
    with pytest.raises(CommDeadlockError, match="in the set-up of communicator") as raised:
        _check(crossed)
    assert raised.value.comms == [F01, F10]
    _check(_plan([[Init(F01), Init(F10)], [Init(F01), Init(F10)]], set_up=False))
    first_use = _plan(
        [
            [Issue((_send(KEY_A, F01, 1, SMALL),)), Issue((_recv(KEY_B, F10, 1),)), Wait((KEY_B,))],
            [Issue((_send(KEY_B, F10, 0, SMALL),)), Issue((_recv(KEY_A, F01, 0),)), Wait((KEY_A,))],
        ],
        set_up=False,
    )
    with pytest.raises(CommDeadlockError, match="in the set-up of communicator"):
        _check(first_use)


def test_a_wait_blocks_the_host_until_its_messages_arrived() -> None:
    """Rank 1 waits for a message rank 0 sends only after hearing from rank 1: a cycle
    through two hosts, no stream involved."""
    plan = _plan(
        [
            [
                Issue((_recv(KEY_B, F10, 1),)),
                Wait((KEY_B,)),
                Issue((_send(KEY_A, F01, 1),)),
                Wait((KEY_A,)),
            ],
            [
                Issue((_recv(KEY_A, F01, 0),)),
                Wait((KEY_A,)),
                Issue((_send(KEY_B, F10, 0),)),
                Wait((KEY_B,)),
            ],
        ]
    )
    with pytest.raises(CommDeadlockError) as raised:
        _check(plan)
    assert raised.value.ranks == [0, 1]


def test_the_inflight_bound_counts_sends_not_yet_known_received() -> None:
    """Rank 0 sends three messages before rank 1 answers: all three are in flight until
    rank 0 receives the answer, which rank 1 sends after receiving them."""
    keys = [(Kind.RECV_F, 1, m) for m in range(3)]
    answer = (Kind.RECV_B, 0, 0)
    b10 = B10
    plan = _plan(
        [
            [
                *(Issue((_send(k, F01, 1),)) for k in keys),
                Issue((_recv(answer, b10, 1),)),
                Wait((answer,)),
                Compute(None),
                Issue((_send((Kind.RECV_F, 1, 9), F01, 1),)),
                Wait((*keys, (Kind.RECV_F, 1, 9))),
            ],
            [
                *(Issue((_recv(k, F01, 0),)) for k in keys),
                Wait(tuple(keys)),
                Issue((_send(answer, b10, 0),)),
                Issue((_recv((Kind.RECV_F, 1, 9), F01, 0),)),
                Wait(((Kind.RECV_F, 1, 9), answer)),
            ],
        ]
    )
    _check(plan)
    # Rank 0: three in flight; after the answer only the fourth. Rank 1: its answer.
    assert inflight_bound(plan) == [3, 1]


def test_channels_on_one_stream_queue_behind_each_other() -> None:
    """Each rank posts a receive on one channel, then sends on another: with a stream
    each both sends go; on one stream each send waits behind its rank's receive."""
    plan = _plan(
        [
            [Issue((_recv(KEY_B, F10, 1),)), Issue((_send(KEY_A, F01, 1),)), Wait((KEY_A, KEY_B))],
            [Issue((_recv(KEY_A, F01, 0),)), Issue((_send(KEY_B, F10, 0),)), Wait((KEY_A, KEY_B))],
        ]
    )
    _check(plan)
    with pytest.raises(CommDeadlockError, match="queued behind rank 0's receive of 1RECV_F1"):
        _check(plan, streams="shared")
    with pytest.raises(ScheduleError, match="unknown streams 'one': use one of shared, distinct"):
        _check(plan, streams="one")


def test_a_wait_returns_when_the_whole_batch_completed() -> None:
    """A batch returns one work: rank 0's Wait for a message received in a batch that also
    sends one never received waits for ever, though its own message arrived."""
    both = Comm("P", (0, 1), channel=False)
    plan = _plan(
        [
            [Issue((_recv(KEY_A, both, 1), _send(KEY_B, both, 1))), Wait((KEY_A,))],
            [Issue((_send(KEY_A, both, 0),)), Wait((KEY_A,))],
        ],
        set_up=False,
    )
    with pytest.raises(CommDeadlockError, match="rank 0's send of 1RECV_F1 to rank 1"):
        _check(plan)


def test_a_collective_completes_at_the_head_of_its_stream() -> None:
    """A data-parallel collective (the same pipeline rank of the other pipelines reaches it
    at the same point) needs nothing from the pipeline: it completes once nothing is
    ahead of it on its stream."""
    group = Comm("DP", (0,), channel=False)
    done = ("collective", "data-parallel reduce-scatter")
    collective = Issue((CommOp("collective", 0, group, done),))
    ahead = _plan(
        [
            [Issue((_recv(KEY_A, F10, 1),)), collective, Wait((done,)), Wait((KEY_A,))],
            [Wait(()), Issue((_send(KEY_A, F10, 0, SMALL),)), Wait((KEY_A,))],
        ]
    )
    _check(ahead)
    _check(ahead, streams="shared")  # the receive's data comes without rank 0's help
    blocked = _plan(
        [
            [
                Issue((_recv(KEY_A, F10, 1),)),
                collective,
                Wait((done,)),
                Issue((_send(KEY_B, F01, 1),)),
                Wait((KEY_A,)),
            ],
            [
                Issue((_recv(KEY_B, F01, 0),)),
                Wait((KEY_B,)),
                Issue((_send(KEY_A, F10, 0),)),
                Wait((KEY_A,)),
            ],
        ]
    )
    _check(blocked)
    with pytest.raises(CommDeadlockError, match="rank 0's data-parallel reduce-scatter on comm"):
        _check(blocked, streams="shared")
