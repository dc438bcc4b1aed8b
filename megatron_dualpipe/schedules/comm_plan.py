"""The communication plan: what each rank hands the backend, and when it waits, as data.

:func:`comm_plan` turns a (lowered) schedule into, per rank, the ordered steps the runtime
executor performs: ``Compute(action)``, ``Issue(ops)`` (one batch of sends and receives
handed to the backend at once, all on one communicator; the host goes on at once) and
``Wait(keys)`` (the host blocks until those messages completed), plus the ``Init(comm)``
steps that set communicators up before the first step. The executor runs exactly this
plan and nothing else; :mod:`.nccl_rules` checks it under NCCL's ordering rules.

Two layouts of communicators:

- ``per-channel`` (what the runtime ships): one two-rank communicator per channel, i.e.
  per (message kind, sender -> receiver). On each of them one rank only sends and the
  other only receives, in the same order, so an operation that holds its communicator's
  stream (a receive waiting for data, a large send waiting for its receive) holds nothing
  another message needs. They are set up eagerly, in one order every rank shares.
- ``per-kind``: one communicator for activations and one for gradients, each over all
  pipeline ranks (the design before: it deadlocks under NCCL's rules, see
  docs/runtime.md). Kept so the check can show why.

Messages are named by their receive key (``(RECV_F | RECV_B, stage, micro-batch)``, as in
:mod:`.lowering`); with variable shapes each message is preceded by a small shape message
whose key adds ``"shape"``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from .ir import COMM_KINDS, Action, Kind, Placement, Schedule, ScheduleError
from .lowering import MessageKey, lower, message_key, peer_of

__all__ = [
    "LAYOUTS",
    "SHAPE_BYTES",
    "Comm",
    "CommOp",
    "CommPlan",
    "Compute",
    "Init",
    "Issue",
    "PlanKey",
    "Step",
    "Wait",
    "channels",
    "comm_plan",
    "key_text",
]

#: ``per-channel`` (shipped) or ``per-kind`` (one communicator per message kind).
LAYOUTS = ("per-channel", "per-kind")
#: What a shape message weighs: a few int64 dimensions, far below any eager limit.
SHAPE_BYTES = 128

#: A message key, or a message key with ``"shape"`` appended for its shape message.
PlanKey = tuple


class Comm(NamedTuple):
    """A communicator: the kind of message it carries (``"F"`` activations, ``"B"``
    gradients) and its member pipeline ranks; a channel's are (sender, receiver).
    (Plans hold tens of thousands of operations: the step types are named tuples.)"""

    kind: str
    ranks: tuple[int, ...]
    channel: bool = True

    def __str__(self) -> str:
        if self.channel:
            return f"{self.kind}{self.ranks[0]}->{self.ranks[1]}"
        return f"{self.kind}-all"

    def setup_order(self) -> tuple:
        """The order every rank sets communicators up in (any one shared order avoids a
        cycle of ranks each waiting in a different communicator's set-up)."""
        return (min(self.ranks), max(self.ranks), self.kind, self.ranks)


class CommOp(NamedTuple):
    """One send or receive of one message, between this rank and ``peer`` on ``comm``.
    ``nbytes`` is the message's size where known (None: unknown, assumed large)."""

    kind: Literal["send", "recv"]
    peer: int
    comm: Comm
    key: PlanKey
    nbytes: int | None = None


class Compute(NamedTuple):
    """Run one compute action of the schedule."""

    action: Action


class Issue(NamedTuple):
    """Hand ``ops`` to the backend as one batch on one communicator; do not wait."""

    ops: tuple[CommOp, ...]

    @property
    def comm(self) -> Comm:
        return self.ops[0].comm


class Wait(NamedTuple):
    """Block until the messages ``keys`` (sent or received by this rank) completed."""

    keys: tuple[PlanKey, ...]


class Init(NamedTuple):
    """Set ``comm`` up (a collective of its members), before the first step."""

    comm: Comm


Step = Compute | Issue | Wait | Init


@dataclass(frozen=True)
class CommPlan:
    """Per rank, the steps of one training (or forward-only) step of ``schedule``."""

    schedule: Schedule
    ranks: list[list[Step]]
    layout: str
    prepost: bool
    variable_shapes: bool
    forward_only: bool

    @property
    def comms(self) -> list[Comm]:
        """Every communicator the plan uses, in set-up order."""
        found = {
            op.comm for steps in self.ranks for s in steps if isinstance(s, Issue) for op in s.ops
        }
        return sorted(found, key=Comm.setup_order)

    def comm_steps(self, rank: int) -> list[Issue | Wait]:
        """Rank ``rank``'s Issue and Wait steps, in order (what it asks of the backend)."""
        return [s for s in self.ranks[rank] if isinstance(s, Issue | Wait)]


def key_text(key: PlanKey) -> str:
    """``2RECV_F1`` for a message, ``2RECV_F1.shape`` for its shape message."""
    kind, stage, mb = key[:3]
    return f"{stage}{kind.value}{mb}" + (".shape" if len(key) > 3 else "")


def channels(placement: Placement) -> list[Comm]:
    """Every channel of ``placement`` (a per-channel communicator of each kind between
    two neighbouring stages on different ranks), in set-up order: what any schedule of
    that placement may use."""
    found = set()
    for stage in range(placement.num_stages):
        nxt = placement.next_stage(stage)
        if nxt is None or not placement.remote_neighbours(stage)[1]:
            continue
        a, b = placement.rank_of(stage), placement.rank_of(nxt)
        found |= {Comm("F", (a, b)), Comm("B", (b, a))}
    return sorted(found, key=Comm.setup_order)


def _comm_of(action: Action, rank: int, placement: Placement, layout: str) -> Comm:
    kind = "F" if action.kind in (Kind.SEND_F, Kind.RECV_F) else "B"
    if layout == "per-kind":
        return Comm(kind, tuple(range(placement.num_ranks)), channel=False)
    peer = peer_of(action, placement)
    sender, receiver = (rank, peer) if action.kind in (Kind.SEND_F, Kind.SEND_B) else (peer, rank)
    return Comm(kind, (sender, receiver))


def _forward_only(actions: Sequence[Action]) -> list[Action]:
    """The forwards and their messages of a rank's lowered actions (an FB's forward half)."""
    forward_kinds = (Kind.F, Kind.SEND_F, Kind.RECV_F)
    return [
        half
        for action in actions
        for half in (action.sub[:1] if action.kind is Kind.FB else (action,))
        if half.kind in forward_kinds
    ]


def _batches(ops: list[CommOp]) -> list[Issue]:
    """``ops`` as one Issue per communicator, communicators in order of first appearance,
    each keeping its ops' order."""
    by_comm: dict[Comm, list[CommOp]] = {}
    for op in ops:
        by_comm.setdefault(op.comm, []).append(op)
    return [Issue(tuple(batch)) for batch in by_comm.values()]


@dataclass
class _Run:
    """A run of adjacent communication actions: its sends and its receives."""

    sends: list[Action]
    receives: list[Action]


class _RankPlanner:
    """Builds one rank's steps."""

    def __init__(
        self,
        rank: int,
        placement: Placement,
        layout: str,
        variable_shapes: bool,
        message_bytes: int | Callable[[MessageKey], int | None] | None,
    ):
        self.rank = rank
        self.placement = placement
        self.layout = layout
        self.variable_shapes = variable_shapes
        self.message_bytes = message_bytes
        self.posted: set[MessageKey] = set()
        self._routes: dict[tuple[Kind, int], tuple[str, int, Comm]] = {}

    def op(self, action: Action, *, shape: bool = False) -> CommOp:
        p = self.placement
        key = message_key(action, p)
        if shape:
            size = SHAPE_BYTES
        elif callable(self.message_bytes):
            size = self.message_bytes(key)
        else:
            size = self.message_bytes
        route = self._routes.get((action.kind, action.stage))
        if route is None:
            kind = "send" if action.kind in (Kind.SEND_F, Kind.SEND_B) else "recv"
            comm = _comm_of(action, self.rank, p, self.layout)
            route = self._routes[(action.kind, action.stage)] = (kind, peer_of(action, p), comm)
        return CommOp(*route, (*key, "shape") if shape else key, size)

    def send_ops(self, sends: list[Action]) -> list[CommOp]:
        """Each message's shape (with variable shapes), then its data."""
        shape = (True, False) if self.variable_shapes else (False,)
        return [self.op(a, shape=s) for a in sends for s in shape]

    def post(self, receives: list[Action]) -> list[CommOp]:
        """The first receive op (shape with variable shapes, else data) of each message
        not posted yet, now registered as posted."""
        fresh = [a for a in receives if message_key(a, self.placement) not in self.posted]
        self.posted.update(message_key(a, self.placement) for a in fresh)
        return [self.op(a, shape=self.variable_shapes) for a in fresh]

    def steps(self, actions: Sequence[Action], prepost: bool) -> list[Step]:
        runs: list[_Run | Action] = []
        for is_comm, group in itertools.groupby(actions, key=lambda a: a.kind in COMM_KINDS):
            if not is_comm:
                runs += group
                continue
            group = list(group)
            runs.append(
                _Run(
                    [a for a in group if a.kind in (Kind.SEND_F, Kind.SEND_B)],
                    [a for a in group if a.kind in (Kind.RECV_F, Kind.RECV_B)],
                )
            )
        comm_runs = [r for r in runs if isinstance(r, _Run)]
        following = dict(zip(map(id, comm_runs), comm_runs[1:], strict=False))
        steps: list[Step] = []
        sent: list[PlanKey] = []
        for run in runs:
            if not isinstance(run, _Run):
                steps.append(Compute(run))
                continue
            sends, receives = run.sends, run.receives
            send_ops = self.send_ops(sends)
            sent += [o.key for o in send_ops]
            steps += _batches(send_ops + self.post(receives))
            keys = [message_key(a, self.placement) for a in receives]
            if self.variable_shapes and receives:
                steps.append(Wait(tuple((*k, "shape") for k in keys)))
                steps += _batches([self.op(a) for a in receives])
            if keys:
                steps.append(Wait(tuple(keys)))
            self.posted.difference_update(keys)
            nxt = following.get(id(run))
            if prepost and nxt is not None:
                steps += _batches(self.post(nxt.receives))
        if sent:
            steps.append(Wait(tuple(sent)))
        return steps


def comm_plan(
    schedule: Schedule,
    *,
    layout: str = "per-channel",
    prepost: bool = True,
    variable_shapes: bool = False,
    message_bytes: int | Callable[[MessageKey], int | None] | None = None,
    eager_init: bool = True,
    forward_only: bool = False,
) -> CommPlan:
    """The communication plan of ``schedule`` (lowered here if it is not yet).

    Each run of adjacent communication actions becomes: one Issue per communicator of its
    sends and of its receives not posted yet, with variable shapes a Wait for the shape
    messages and an Issue of the data receives, then a Wait for its receives. With
    ``prepost`` the next run's receives (their shape messages, with variable shapes) are
    issued right after, so their data can land during compute. The step ends with a Wait
    for every send. ``message_bytes`` gives each message's size (a number for all, or a
    function of the message key); ``eager_init`` puts an Init of every communicator a rank
    is a member of, in the shared set-up order, before its first step.
    """
    if layout not in LAYOUTS:
        raise ScheduleError(
            f"unknown communicator layout {layout!r}: use one of {', '.join(LAYOUTS)}"
        )
    lowered = schedule if schedule.is_lowered else lower(schedule)
    p = lowered.placement
    ranks = []
    for rank, actions in enumerate(lowered.ranks):
        planner = _RankPlanner(rank, p, layout, variable_shapes, message_bytes)
        ranks.append(planner.steps(_forward_only(actions) if forward_only else actions, prepost))
    plan = CommPlan(lowered, ranks, layout, prepost, variable_shapes, forward_only)
    if eager_init:
        comms = plan.comms
        for rank, steps in enumerate(ranks):
            steps[:0] = [Init(c) for c in comms if rank in c.ranks]
    return plan
