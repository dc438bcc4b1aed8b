"""The communication plan and the model of NCCL's ordering rules (pure Python).

- The shipped plan (one two-rank communicator per channel, receives pre-posted one run
  ahead, eager set-up in one shared order) finishes under NCCL's rules for every
  registered schedule at PP 2..16 and micro-batches 2PP..4PP+2, whether every send waits
  for its receive (large messages) or completes into the receiver's buffer (small ones).
- The design before it (one communicator per message kind, over all pipeline ranks) is
  reported as a deadlock for dualpipe and dualpipev at every PP, the cycle named.
- The model's rules, each on a hand-made plan: rendezvous and eager sends, in-order
  matching (a mismatch is named), lazy set-up in different orders (a cycle), waits.
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
    channels,
    comm_plan,
)
from megatron_dualpipe.schedules.ir import Kind, Placement, Schedule, ScheduleError
from megatron_dualpipe.schedules.lowering import lower
from megatron_dualpipe.schedules.nccl_rules import CommDeadlockError, check_nccl, inflight_bound
from megatron_dualpipe.schedules.registry import SCHEDULES, generate, spec
from megatron_dualpipe.schedules.validate import validate

LARGE, SMALL = 2**30, 1024


def _microbatches(name: str, pp: int) -> list[int]:
    """The legal micro-batch counts of ``name`` at ``pp`` from 2 PP to 4 PP + 2."""
    s = spec(name)
    return [m for m in range(2 * pp, 4 * pp + 3) if s.problem(pp, m) is None]


def _legal(name: str, pp: int) -> bool:
    return spec(name).problem(pp, spec(name).min_microbatches(pp)) is None  # dualpipe: even PP


FAST = [(n, pp) for n, pp in itertools.product(SCHEDULES, (2, 3, 4)) if _legal(n, pp)]
FULL = [
    (n, pp)
    for n, pp in itertools.product(SCHEDULES, range(2, 17))
    if _legal(n, pp) and (n, pp) not in FAST
]


@pytest.mark.parametrize(
    ("name", "pp"), [*FAST, *(pytest.param(*c, marks=pytest.mark.slow) for c in FULL)]
)
def test_the_shipped_plan_finishes_under_nccls_rules(name: str, pp: int) -> None:
    """Every legal micro-batch count from 2 PP to 4 PP + 2, large messages (each send waits
    for its receive: the stricter rule); small ones and forward-only steps at the ends."""
    counts = _microbatches(name, pp)
    for m in counts:
        schedule = generate(name, pp, m)
        validate(schedule, backend="nccl", message_bytes=LARGE)
        if m in (counts[0], counts[-1]):
            validate(schedule, backend="nccl", message_bytes=SMALL)
            validate(schedule, backend="nccl", forward_only=True)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
@pytest.mark.parametrize("pp", [2, 4, 8, 16])
def test_one_communicator_per_message_kind_deadlocks_and_the_cycle_is_named(name, pp) -> None:
    schedule = generate(name, pp, 2 * pp)
    with pytest.raises(CommDeadlockError) as raised:
        validate(schedule, backend="nccl", layout="per-kind")
    error = raised.value
    message = str(error)
    assert message.startswith("the plan deadlocks under NCCL's rules: ")
    assert len(error.ranks) >= 2 and all(f"rank {r}" in message for r in error.ranks)
    assert error.comms and all(not c.channel for c in error.comms)
    lowered = lower(schedule)
    keys = {
        ("RECV_F" if a.kind in (Kind.SEND_F, Kind.RECV_F) else "RECV_B")
        for acts in lowered.ranks
        for a in acts
    }
    assert error.keys and all(k[0].value in keys for k in error.keys)
    assert message.count(" again (ranks ") == 1  # the cycle closes, once


def test_without_preposting_only_large_messages_deadlock_the_old_design() -> None:
    """NCCL's buffer saves small messages: without pre-posted receives the old design
    runs dualpipev at PP=4 when messages are small, and deadlocks when they are large."""
    schedule = generate("dualpipev", 4, 8)
    options = {"layout": "per-kind", "prepost": False}
    validate(schedule, backend="nccl", message_bytes=SMALL, **options)
    with pytest.raises(CommDeadlockError):
        validate(schedule, backend="nccl", message_bytes=LARGE, **options)


def test_the_deepseek_v3_configuration_passes() -> None:
    """DualPipe over PP=16 with 120 micro-batches, as in DeepSeek-V3's report."""
    report = check_nccl(comm_plan(generate("dualpipe", 16, 120)))
    assert len(report.comms) == 60  # 15 neighbour pairs x 4 channels
    assert max(report.comms_per_rank) == 8 and report.comms_per_rank[0] == 4


def test_a_per_channel_plan_has_one_sender_and_one_receiver_per_communicator() -> None:
    for name in ("zb1p", "dualpipe", "dualpipev"):
        plan = comm_plan(generate(name, 4, 10))
        assert set(plan.comms) <= set(channels(plan.schedule.placement))
        senders, receivers = {}, {}
        for rank, steps in enumerate(plan.ranks):
            inits = [s.comm for s in steps if isinstance(s, Init)]
            assert inits == sorted(inits, key=Comm.setup_order)  # one shared order
            assert all(isinstance(s, Init) for s in steps[: len(inits)])
            received, waited = [], []
            for step in steps:
                if isinstance(step, Issue):
                    assert {op.comm for op in step.ops} == {step.comm}
                    for op in step.ops:
                        side = senders if op.kind == "send" else receivers
                        side.setdefault(op.comm, set()).add(rank)
                        if op.kind == "recv":
                            received.append(op.key)
                elif isinstance(step, Wait):
                    waited += step.keys
            assert sorted(received) == sorted(k for k in waited if k in set(received))
            assert len(set(waited)) == len(waited)  # each message waited on once
        for comm in plan.comms:
            assert senders[comm] == {comm.ranks[0]} and receivers[comm] == {comm.ranks[1]}


# -- the rules, on hand-made plans -----------------------------------------------------
PLACEMENT = Placement("loop", 2, 2, 2)
F01, F10, B10 = Comm("F", (0, 1)), Comm("F", (1, 0)), Comm("B", (1, 0))
KEY_A, KEY_B = (Kind.RECV_F, 1, 0), (Kind.RECV_F, 1, 1)


def _plan(ranks: list[list], set_up: bool = True) -> CommPlan:
    """A plan of two ranks' steps, with both channels set up first in one order (unless
    not ``set_up``: then each is set up where first used)."""
    schedule = Schedule("hand", PLACEMENT, [[], []])
    if set_up:
        ranks = [[Init(F01), Init(F10), Init(B10), *steps] for steps in ranks]
    return CommPlan(schedule, ranks, "per-channel", False, False, False)


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
    check_nccl(plan)  # a Wait on a send alone never needs the peer's host first
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
        check_nccl(blocked)
    else:
        with pytest.raises(CommDeadlockError, match="waits for its match from"):
            check_nccl(blocked)


def test_messages_between_two_ranks_match_in_issue_order() -> None:
    plan = _plan(
        [
            [Issue((_send(KEY_A, F01, 1), _send(KEY_B, F01, 1))), Wait((KEY_A, KEY_B))],
            [Issue((_recv(KEY_B, F01, 0), _recv(KEY_A, F01, 0))), Wait((KEY_A, KEY_B))],
        ]
    )
    with pytest.raises(ScheduleError, match="would get the data of rank 0's send of 1RECV_F0"):
        check_nccl(plan)


def test_communicators_set_up_in_different_orders_deadlock() -> None:
    """Setting a communicator up blocks each member until all arrive: explicitly (Init) or
    at its first use, where ranks first use different ones."""
    crossed = _plan([[Init(F01), Init(F10)], [Init(F10), Init(F01)]], set_up=False)
    with pytest.raises(CommDeadlockError, match="in the set-up of communicator") as raised:
        check_nccl(crossed)
    assert raised.value.comms == [F01, F10]
    check_nccl(_plan([[Init(F01), Init(F10)], [Init(F01), Init(F10)]], set_up=False))
    first_use = _plan(
        [
            [Issue((_send(KEY_A, F01, 1, SMALL),)), Issue((_recv(KEY_B, F10, 1),)), Wait((KEY_B,))],
            [Issue((_send(KEY_B, F10, 0, SMALL),)), Issue((_recv(KEY_A, F01, 0),)), Wait((KEY_A,))],
        ],
        set_up=False,
    )
    with pytest.raises(CommDeadlockError, match="in the set-up of communicator"):
        check_nccl(first_use)


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
        check_nccl(plan)
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
    check_nccl(plan)
    # Rank 0: three in flight; after the answer only the fourth. Rank 1: its answer.
    assert inflight_bound(plan) == [3, 1]
