"""The communication plan: what each rank hands the backend, and when it waits, as data.

:func:`comm_plan` turns a schedule into, per rank, the ordered steps the runtime executor
performs: ``Compute(action)``, ``Issue(ops)`` (one batch on one communicator; the host goes
on), ``Wait(keys)`` (the host blocks until those messages' batches completed) and the
``Init(comm)`` steps before the first. The plan is lock-step: one communicator over the
pipeline's ranks, and at each exchange point (:mod:`.exchange`'s rounds) one batch of every
message due there, waited before the next compute. The executor runs exactly this plan;
:mod:`.nccl_rules` checks it. Why this design: docs/runtime.md, "Communication on NCCL".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from .exchange import Exchange, exchange_points
from .ir import COMPUTE_KINDS, Action, Kind, Placement, Schedule
from .lowering import MessageKey, lower

__all__ = [
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
    "comm_plan",
    "key_text",
    "pipeline_comm",
]

#: What a shape message weighs: a few int64 dimensions, far below any eager limit.
SHAPE_BYTES = 128

#: A message key, or a message key with ``"shape"`` appended for its shape message.
PlanKey = tuple


#: How communicators that are not channels are named, by kind (others: ``KIND-all``).
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


def pipeline_comm(placement: Placement) -> Comm:
    """The lock-step plan's one communicator, over every rank of the pipeline."""
    return Comm("P", tuple(range(placement.num_ranks)), channel=False)


Sizes = int | Callable[[MessageKey], int | None] | None


def _size(message_bytes: Sizes, key: MessageKey, shape: bool) -> int | None:
    """A message's size in bytes (its shape message's with ``shape``), None if unknown."""
    if shape:
        return SHAPE_BYTES
    return message_bytes(key) if callable(message_bytes) else message_bytes


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
    if not forward_only:
        return computes
    halves = (half for a in computes for half in (a.sub[:1] if a.kind is Kind.FB else (a,)))
    return [half for half in halves if half.kind is Kind.F]


def comm_plan(
    schedule: Schedule,
    *,
    variable_shapes: bool = False,
    message_bytes: Sizes = None,
    forward_only: bool = False,
) -> CommPlan:
    """The communication plan of ``schedule`` (lowered here if it is not yet).

    Every message goes to an exchange point of its sender and of its receiver
    (:func:`~.exchange.exchange_points`; a lowered schedule's own send and receive
    positions are not used): one Issue of the point's sends and receives, then a Wait for
    all of them. ``message_bytes`` gives each message's size (a number for all, or a
    function of the message key). Each rank's plan starts with an Init of every communicator
    it is a member of, in the shared set-up order.
    """
    lowered = schedule if schedule.is_lowered else lower(schedule)
    computes = [_computes(actions, forward_only) for actions in lowered.ranks]
    points = exchange_points(lowered, computes)
    comm = pipeline_comm(lowered.placement)
    ranks = [
        _lock_step(boundaries, actions, comm, variable_shapes, message_bytes)
        for boundaries, actions in zip(points, computes, strict=True)
    ]
    plan = CommPlan(lowered, ranks, variable_shapes, forward_only)
    comms = plan.comms
    for rank, steps in enumerate(ranks):
        steps[:0] = [Init(c) for c in comms if rank in c.ranks]
    return plan
