"""The communication plan: what each rank hands the backend, and when it waits, as data.

:func:`comm_plan` turns a schedule into, per rank, the ordered steps the runtime executor
performs: ``Compute(action)``, ``Issue(ops)`` (one batch handed to the backend at once, all
on one communicator; the host goes on at once) and ``Wait(keys)`` (the host blocks until
the batches holding those messages completed), plus the ``Init(comm)`` steps that set
communicators up before the first step. The executor runs exactly this plan and nothing
else; :mod:`.nccl_rules` checks it under NCCL's ordering rules.

Layouts:

- ``lock-step`` (what the runtime ships): one communicator over the pipeline's ranks and,
  as in DeepSeek's DualPipe, one batch at each exchange point (before each compute and
  after the last) of every message due there, sends and receives together, waited before
  the next compute: nothing is pending while a rank computes. Which exchange point each
  message goes to is :mod:`.exchange`'s round; with it the plan finishes under NCCL's
  rules with all of a rank's communicators on one stream (docs/runtime.md).
- ``per-channel`` (the design before): one two-rank communicator per channel, i.e. per
  (message kind, sender -> receiver), each run of adjacent communication actions of the
  lowered schedule one Issue per communicator, the next run's receives pre-posted. It
  finishes only if every communicator has a stream of its own.
- ``per-kind`` (the design before that): one communicator for activations and one for
  gradients, each over all pipeline ranks, batched as ``per-channel``.

The two older layouts are kept so that the check can show why they fail.

Messages are named by their receive key (``(RECV_F | RECV_B, stage, micro-batch)``, as in
:mod:`.lowering`); with variable shapes each message is preceded by a small shape message
whose key adds ``"shape"``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from .exchange import Exchange, exchange_points
from .ir import COMM_KINDS, COMPUTE_KINDS, Action, Kind, Placement, Schedule, ScheduleError
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
    "pipeline_comm",
]

#: ``lock-step`` (shipped), ``per-channel`` and ``per-kind`` (the designs before it).
LAYOUTS = ("lock-step", "per-channel", "per-kind")
#: What a shape message weighs: a few int64 dimensions, far below any eager limit.
SHAPE_BYTES = 128

#: A message key, or a message key with ``"shape"`` appended for its shape message.
PlanKey = tuple


#: How communicators that are not channels are named, by kind (else ``F-all``, ``B-all``).
_GROUP_NAMES = {"P": "pipeline", "DP": "data-parallel", "EP": "expert-parallel"}


class Comm(NamedTuple):
    """A communicator: what it carries (``"F"`` activations, ``"B"`` gradients, ``"P"``
    both: the lock-step plan's pipeline communicator; ``"DP"``, ``"EP"``: a data- or
    expert-parallel group, for the NCCL model) and its member pipeline ranks; a channel's
    are (sender, receiver). (Plans hold tens of thousands of operations: the step types
    are named tuples.)"""

    kind: str
    ranks: tuple[int, ...]
    channel: bool = True

    def __str__(self) -> str:
        if self.channel:
            return f"{self.kind}{self.ranks[0]}->{self.ranks[1]}"
        return _GROUP_NAMES.get(self.kind, f"{self.kind}-all")

    def setup_order(self) -> tuple:
        """The order every rank sets communicators up in (any one shared order avoids a
        cycle of ranks each waiting in a different communicator's set-up)."""
        return (min(self.ranks), max(self.ranks), self.kind, self.ranks)


class CommOp(NamedTuple):
    """One send or receive of one message, between this rank and ``peer`` on ``comm``
    (or, for the NCCL model only, a ``collective`` of another group: ``peer`` is the rank
    itself). ``nbytes`` is the message's size where known (None: unknown, assumed large)."""

    kind: Literal["send", "recv", "collective"]
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
    """Block until the messages ``keys`` (sent or received by this rank) completed: on
    NCCL, until the whole batch holding each completed (a batch returns one work)."""

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

    def peers(self, rank: int, comm: Comm) -> list[int]:
        """The ranks ``rank`` exchanges messages with on ``comm``, in order."""
        found = {
            op.peer
            for s in self.ranks[rank]
            if isinstance(s, Issue)
            for op in s.ops
            if op.comm == comm
        }
        return sorted(found)

    def comm_steps(self, rank: int) -> list[Issue | Wait]:
        """Rank ``rank``'s Issue and Wait steps, in order (what it asks of the backend)."""
        return [s for s in self.ranks[rank] if isinstance(s, Issue | Wait)]


def key_text(key: PlanKey) -> str:
    """``2RECV_F1`` for a message, ``2RECV_F1.shape`` for its shape message (a collective's
    key is ``("collective", its text)``)."""
    if key[0] == "collective":
        return key[1]
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


def pipeline_comm(placement: Placement) -> Comm:
    """The lock-step plan's one communicator, over every rank of the pipeline."""
    return Comm("P", tuple(range(placement.num_ranks)), channel=False)


def _comm_of(action: Action, rank: int, placement: Placement, layout: str) -> Comm:
    kind = "F" if action.kind in (Kind.SEND_F, Kind.RECV_F) else "B"
    if layout == "per-kind":
        return Comm(kind, tuple(range(placement.num_ranks)), channel=False)
    peer = peer_of(action, placement)
    sender, receiver = (rank, peer) if action.kind in (Kind.SEND_F, Kind.SEND_B) else (peer, rank)
    return Comm(kind, (sender, receiver))


Sizes = int | Callable[[MessageKey], int | None] | None


def _size(message_bytes: Sizes, key: MessageKey, shape: bool) -> int | None:
    """A message's size in bytes (its shape message's with ``shape``), None if unknown."""
    if shape:
        return SHAPE_BYTES
    return message_bytes(key) if callable(message_bytes) else message_bytes


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
        message_bytes: Sizes,
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
        size = _size(self.message_bytes, key, shape)
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


def _lock_step(
    boundaries: list[list[Exchange]],
    computes: Sequence[Action],
    comm: Comm,
    variable_shapes: bool,
    message_bytes: Sizes,
) -> list[Step]:
    """One rank's lock-step plan: at each exchange point one batch of its exchanges,
    waited before the next compute (with variable shapes, per round: a batch of shape
    messages, waited, then one of the data)."""
    steps: list[Step] = []
    for point, exchanges in enumerate(boundaries):
        rounds = [exchanges]
        if variable_shapes:
            rounds = [list(g) for _, g in itertools.groupby(exchanges, key=lambda e: e.round)]
        for group in rounds if exchanges else ():
            for shape in (True, False) if variable_shapes else (False,):
                ops = tuple(
                    CommOp(
                        e.kind,
                        e.peer,
                        comm,
                        (*e.key, "shape") if shape else e.key,
                        _size(message_bytes, e.key, shape),
                    )
                    for e in group
                )
                steps += [Issue(ops), Wait(tuple(op.key for op in ops))]
        if point < len(computes):
            steps.append(Compute(computes[point]))
    return steps


def _computes(actions: Sequence[Action], forward_only: bool) -> list[Action]:
    """A rank's compute actions in order (a forward-only step: its forwards, an FB's
    forward half among them)."""
    computes = [a for a in actions if a.kind in COMPUTE_KINDS]
    return [a for a in _forward_only(computes) if a.kind is Kind.F] if forward_only else computes


def comm_plan(
    schedule: Schedule,
    *,
    layout: str = "lock-step",
    prepost: bool = True,
    variable_shapes: bool = False,
    message_bytes: Sizes = None,
    eager_init: bool = True,
    forward_only: bool = False,
) -> CommPlan:
    """The communication plan of ``schedule`` (lowered here if it is not yet).

    ``lock-step`` (the default) places every message at an exchange point of its sender
    and of its receiver (:func:`~.exchange.exchange_points`; a lowered schedule's own
    send and receive positions are not used): one Issue of the point's sends and receives,
    then a Wait for all of them. The older layouts turn each run of adjacent communication
    actions of the lowered schedule into one Issue per communicator of its sends and of
    its receives not posted yet, with variable shapes a Wait for the shape messages and an
    Issue of the data receives, then a Wait for its receives; with ``prepost`` the next
    run's receives (their shape messages, with variable shapes) are issued right after;
    the step ends with a Wait for every send. ``message_bytes`` gives each message's size
    (a number for all, or a function of the message key); ``eager_init`` puts an Init of
    every communicator a rank is a member of, in the shared set-up order, before its
    first step.
    """
    if layout not in LAYOUTS:
        raise ScheduleError(
            f"unknown communicator layout {layout!r}: use one of {', '.join(LAYOUTS)}"
        )
    lowered = schedule if schedule.is_lowered else lower(schedule)
    p = lowered.placement
    ranks = []
    if layout == "lock-step":
        computes = [_computes(actions, forward_only) for actions in lowered.ranks]
        points = exchange_points(lowered, computes)
        comm = pipeline_comm(p)
        for boundaries, actions in zip(points, computes, strict=True):
            ranks.append(_lock_step(boundaries, actions, comm, variable_shapes, message_bytes))
    else:
        for rank, actions in enumerate(lowered.ranks):
            planner = _RankPlanner(rank, p, layout, variable_shapes, message_bytes)
            own = _forward_only(actions) if forward_only else actions
            ranks.append(planner.steps(own, prepost))
    posted = prepost and layout != "lock-step"  # the lock-step plan posts nothing ahead
    plan = CommPlan(lowered, ranks, layout, posted, variable_shapes, forward_only)
    if eager_init:
        comms = plan.comms
        for rank, steps in enumerate(ranks):
            steps[:0] = [Init(c) for c in comms if rank in c.ranks]
    return plan
