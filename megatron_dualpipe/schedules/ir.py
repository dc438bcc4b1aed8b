"""The schedule IR: per-rank ordered lists of actions on (stage, micro-batch).

A *stage* is a pipeline stage id in ``0 .. num_stages-1``; the :class:`Placement` says on
which rank and in which rank-local chunk it lives, and which stages each micro-batch flows
through. Generators write compute actions only (F, B, W, BW, FB); the lowering pass adds
SEND_F / RECV_F / SEND_B / RECV_B.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from ..errors import DualPipeError

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Action",
    "Kind",
    "Placement",
    "Schedule",
    "ScheduleError",
    "action_span_name",
    "action_text",
    "parse_action",
]


class ScheduleError(DualPipeError, ValueError):
    """A schedule, its parameters or its text is not valid; the message says what to change."""


class Kind(str, Enum):
    """What an action does."""

    F = "F"  # forward of one stage on one micro-batch
    B = "B"  # input gradient (dX) only; its W comes later
    W = "W"  # weight gradient (dW) only, of an earlier B
    BW = "BW"  # full backward: dX and dW together
    FB = "FB"  # a forward and a backward of two (stage, micro-batch) pairs, issued together
    SEND_F = "SEND_F"  # send a stage's forward output to the next stage's rank
    RECV_F = "RECV_F"  # receive a stage's forward input from the previous stage's rank
    SEND_B = "SEND_B"  # send a stage's input gradient to the previous stage's rank
    RECV_B = "RECV_B"  # receive the gradient of a stage's output from the next stage's rank


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW, Kind.FB})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})


class Action(NamedTuple):
    """One step of one rank. An FB action keeps its forward and backward halves in ``sub``;
    its own stage, chunk and micro-batch are those of the forward half. (A named tuple:
    schedules hold hundreds of thousands of these.)"""

    kind: Kind
    stage: int
    microbatch: int
    chunk: int = 0
    sub: tuple[Action, ...] = ()

    @staticmethod
    def overlapped(forward: Action, backward: Action) -> Action:
        """The FB action that issues ``forward`` and ``backward`` together."""
        if forward.kind is not Kind.F or backward.kind not in (Kind.B, Kind.BW):
            raise ScheduleError(f"FB needs a forward and a backward, got {forward} and {backward}")
        pair = (forward, backward)
        return Action(Kind.FB, forward.stage, forward.microbatch, forward.chunk, pair)

    @property
    def computes(self) -> tuple[Action, ...]:
        """The plain compute actions this action performs (its halves for FB, else itself)."""
        return self.sub if self.kind is Kind.FB else (self,)

    def __str__(self) -> str:
        if self.kind is Kind.FB:
            return f"({self.sub[0]};{self.sub[1]})FB"
        return action_text(self.kind, self.stage, self.microbatch)

    def to_json(self) -> dict:
        out = {
            "kind": self.kind.value,
            "stage": self.stage,
            "chunk": self.chunk,
            "microbatch": self.microbatch,
        }
        if self.sub:
            out["sub"] = [a.to_json() for a in self.sub]
        return out

    @staticmethod
    def from_json(data: dict) -> Action:
        sub = tuple(Action.from_json(s) for s in data.get("sub", ()))
        return Action(Kind(data["kind"]), data["stage"], data["microbatch"], data["chunk"], sub)


def action_text(kind: Kind, stage: int, microbatch: int) -> str:
    """How an action or a message key prints: stage, kind, micro-batch (``3F5``, ``1RECV_B0``)."""
    return f"{stage}{kind.value}{microbatch}"


_TOKEN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BW|F|B|W)(\d+)$")
_FB_TOKEN = re.compile(r"^\((.+);(.+)\)FB$")


def parse_action(token: str, placement: Placement) -> Action:
    """Parse one text token (``3F5``, ``2BW1``, ``(0F4;7B1)FB``, ``1SEND_F2``)."""
    match = _FB_TOKEN.match(token)
    if match:
        return Action.overlapped(
            parse_action(match.group(1), placement), parse_action(match.group(2), placement)
        )
    match = _TOKEN.match(token)
    if not match:
        raise ScheduleError(
            f"cannot read action {token!r}: write STAGE KIND MICROBATCH such as 3F5, 2B1, 2W1, "
            "2BW1 or (0F4;7B1)FB"
        )
    stage, kind, mb = int(match.group(1)), Kind(match.group(2)), int(match.group(3))
    placement.check_stage(stage)
    return Action(kind, stage, mb, placement.chunk_of(stage))


PLACEMENT_KINDS = ("loop", "v", "mirror")


@dataclass(frozen=True)
class Placement:
    """Where stages live and which stages each micro-batch passes through.

    - ``loop``: stage s on rank ``s % R``, chunk ``s // R`` (1F1B, interleaved); every
      micro-batch passes stages ``0 .. S-1``.
    - ``v``: ``2R`` stages in a V: rank r holds stage r (chunk 0) and stage ``2R-1-r``
      (chunk 1); every micro-batch passes all stages (DualPipeV).
    - ``mirror``: two copies of an R-stage model (DualPipe). Stages ``0 .. R-1`` are
      direction 0 (stage s on rank s, chunk 0); stages ``R .. 2R-1`` are direction 1
      (stage ``R+s`` is model stage s on rank ``R-1-s``, chunk 1). The first half of the
      micro-batches runs direction 0, the second half direction 1.
    """

    kind: str
    num_ranks: int
    num_stages: int
    num_microbatches: int

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENT_KINDS:
            raise ScheduleError(
                f"unknown placement {self.kind!r}: use one of {', '.join(PLACEMENT_KINDS)}"
            )
        if self.num_ranks < 1 or self.num_microbatches < 1:
            raise ScheduleError("a schedule needs at least one rank and one micro-batch")
        if self.kind == "loop" and self.num_stages % self.num_ranks:
            raise ScheduleError(
                f"loop placement needs stages ({self.num_stages}) divisible by ranks "
                f"({self.num_ranks})"
            )
        if self.kind in ("v", "mirror") and self.num_stages != 2 * self.num_ranks:
            raise ScheduleError(f"{self.kind} placement needs exactly 2 stages per rank")
        if self.kind == "mirror" and self.num_microbatches % 2:
            raise ScheduleError(
                f"mirror placement needs an even number of micro-batches, got "
                f"{self.num_microbatches}: half enter at each end"
            )

    @property
    def num_chunks(self) -> int:
        """Stages (model chunks) per rank."""
        return self.num_stages // self.num_ranks

    def check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise ScheduleError(f"stage {stage} is out of range 0..{self.num_stages - 1}")

    def rank_of(self, stage: int) -> int:
        if self.kind == "loop":
            return stage % self.num_ranks
        return stage if stage < self.num_ranks else self.num_stages - 1 - stage

    def chunk_of(self, stage: int) -> int:
        if self.kind == "loop":
            return stage // self.num_ranks
        return 0 if stage < self.num_ranks else 1

    def stage_of(self, rank: int, chunk: int) -> int:
        if self.kind == "loop":
            return chunk * self.num_ranks + rank
        return rank if chunk == 0 else self.num_stages - 1 - rank

    def path(self, microbatch: int) -> range:
        """The stages micro-batch ``microbatch`` passes through, in forward order."""
        if self.kind != "mirror":
            return range(self.num_stages)
        if microbatch < self.num_microbatches // 2:
            return range(self.num_ranks)
        return range(self.num_ranks, self.num_stages)

    def prev_stage(self, stage: int) -> int | None:
        """The stage feeding ``stage`` (None where data enters)."""
        if stage == 0 or (self.kind == "mirror" and stage == self.num_ranks):
            return None
        return stage - 1

    def next_stage(self, stage: int) -> int | None:
        """The stage ``stage`` feeds (None where the loss is computed)."""
        if stage == self.num_stages - 1 or (self.kind == "mirror" and stage == self.num_ranks - 1):
            return None
        return stage + 1

    def remote_neighbours(self, stage: int) -> tuple[bool, bool]:
        """Whether the stage feeding ``stage`` and the stage it feeds live on another rank
        (False where there is no such stage)."""
        prev, nxt = self.prev_stage(stage), self.next_stage(stage)
        rank = self.rank_of(stage)
        return (
            prev is not None and self.rank_of(prev) != rank,
            nxt is not None and self.rank_of(nxt) != rank,
        )

    def model_stage(self, stage: int) -> int:
        """Which part of the model a stage runs (mirror copies share one)."""
        return stage % self.num_ranks if self.kind == "mirror" else stage

    @property
    def num_model_stages(self) -> int:
        return self.num_ranks if self.kind == "mirror" else self.num_stages

    @property
    def param_factor(self) -> float:
        """Parameters held per rank, relative to an even 1/R share of the model."""
        return 2.0 if self.kind == "mirror" else 1.0

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "ranks": self.num_ranks,
            "stages": self.num_stages,
            "microbatches": self.num_microbatches,
        }

    @staticmethod
    def from_json(data: dict) -> Placement:
        return Placement(data["kind"], data["ranks"], data["stages"], data["microbatches"])


@dataclass
class Schedule:
    """A named schedule: the placement and, per rank, its actions in execution order."""

    name: str
    placement: Placement
    ranks: list[list[Action]]
    #: Live activations (in stage x micro-batch units) the schedule promises per rank, if stated.
    activation_bound: list[int] | None = field(default=None)

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def num_microbatches(self) -> int:
        return self.placement.num_microbatches

    @property
    def is_lowered(self) -> bool:
        return any(a.kind in COMM_KINDS for actions in self.ranks for a in actions)

    def compute_only(self) -> Schedule:
        """The same schedule without communication actions."""
        return Schedule(
            self.name,
            self.placement,
            [[a for a in acts if a.kind in COMPUTE_KINDS] for acts in self.ranks],
            self.activation_bound,
        )

    def with_weight_grads_in_b_order(self) -> Schedule:
        """The same schedule with each stage's W actions relabelled so that its k-th W is
        the weight gradient of its k-th B: the order a first-in first-out store of deferred
        weight gradients (ours, Transformer Engine's) runs them in. Each W still follows
        its B; under per-stage costs the times and the peaks are the same."""
        ranks = []
        for rank, actions in enumerate(self.ranks):
            pending: dict[int, deque[int]] = {}
            relabelled = []
            for action in actions:
                for half in action.computes:
                    if half.kind is Kind.B:
                        pending.setdefault(half.stage, deque()).append(half.microbatch)
                if action.kind is Kind.W:
                    if not pending.get(action.stage):
                        raise ScheduleError(f"rank {rank}: {action} has no B before it")
                    action = action._replace(microbatch=pending[action.stage].popleft())
                relabelled.append(action)
            ranks.append(relabelled)
        return Schedule(self.name, self.placement, ranks, self.activation_bound)

    # -- text form --------------------------------------------------------------------
    def to_text(self) -> str:
        """One header line, then one line per rank: ``R: token token ...``."""
        p = self.placement
        lines = [
            "# megatron-dualpipe schedule: one line per rank, actions in execution order",
            f"name={self.name} placement={p.kind} ranks={p.num_ranks} stages={p.num_stages} "
            f"microbatches={p.num_microbatches}",
        ]
        lines += [f"{r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.ranks)]
        return "\n".join(lines) + "\n"

    @staticmethod
    def from_text(text: str) -> Schedule:
        header: dict[str, str] | None = None
        rank_lines: dict[int, list[str]] = {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if header is None:
                try:
                    header = dict(item.split("=", 1) for item in line.split())
                except ValueError:
                    raise ScheduleError(
                        f"line {lineno}: expected the header 'name=... placement=... ranks=N "
                        "stages=N microbatches=N'"
                    ) from None
                continue
            rank, sep, tokens = line.partition(":")
            if not sep or not rank.strip().isdigit():
                raise ScheduleError(f"line {lineno}: expected 'RANK: actions...', got {raw!r}")
            rank_lines[int(rank)] = tokens.split()
        if header is None:
            raise ScheduleError("the schedule text has no header line")
        missing = {"name", "placement", "ranks", "stages", "microbatches"} - header.keys()
        if missing:
            raise ScheduleError(f"the header lacks {', '.join(sorted(missing))}")
        placement = Placement(
            header["placement"],
            int(header["ranks"]),
            int(header["stages"]),
            int(header["microbatches"]),
        )
        if sorted(rank_lines) != list(range(placement.num_ranks)):
            raise ScheduleError(
                f"expected one line for each rank 0..{placement.num_ranks - 1}, got ranks "
                f"{sorted(rank_lines)}"
            )
        ranks = [[parse_action(t, placement) for t in rank_lines[r]] for r in sorted(rank_lines)]
        return Schedule(header["name"], placement, ranks)

    # -- JSON form --------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "name": self.name,
            "placement": self.placement.to_json(),
            "activation_bound": self.activation_bound,
            "ranks": [[a.to_json() for a in acts] for acts in self.ranks],
        }

    @staticmethod
    def from_json(data: dict) -> Schedule:
        return Schedule(
            data["name"],
            Placement.from_json(data["placement"]),
            [[Action.from_json(a) for a in acts] for acts in data["ranks"]],
            data.get("activation_bound"),
        )


def action_span_name(
    kind: str, stage: int, microbatch: int, other: tuple[int, int] | None = None
) -> str:
    """The span name the executor gives an action: ``F stage=2 mb=5``; an FB pair names its
    backward half too (``FB stage=0 mb=4 + stage=7 mb=1``); a half run on its own is
    ``FB/F ...`` or ``FB/BW ...``."""
    name = f"{kind} stage={stage} mb={microbatch}"
    return name if other is None else f"{name} + stage={other[0]} mb={other[1]}"
