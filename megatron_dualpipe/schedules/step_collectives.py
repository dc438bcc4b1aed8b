"""The collectives a training step issues on other groups, where Megatron issues them.

A rank's data- and expert-parallel communicators may share a stream with the pipeline's
(:mod:`.nccl_rules`), where a collective queued behind a pipeline receive waits for it, so
the NCCL model runs a plan with them put in (:func:`with_collectives`) at the points of the
step where Megatron-Core issues them: ``dp-reduce-scatter`` in a chunk's grad-final
computes (:func:`grad_final_points`), waited after the step; ``dp-all-gather`` at the
step's start, waited in each chunk's first forward; ``ep-all-to-all`` within every F, B, BW
and FB. Each is an operation of kind ``collective`` (:class:`~.comm_plan.CommOp`) of the
communicator ``DP`` or ``EP``, complete once it reaches the head of its rank's stream.
Where and why Megatron issues each: docs/runtime.md, "Communication on NCCL".
"""

from __future__ import annotations

from collections.abc import Sequence

from .comm_plan import Comm, CommOp, CommPlan, Compute, Issue, Step, Wait
from .ir import Action, Kind, ScheduleError

__all__ = ["COLLECTIVES", "grad_final_points", "with_collectives"]

#: The collectives :func:`with_collectives` can put in (all of them: the worst case).
COLLECTIVES = ("dp-reduce-scatter", "dp-all-gather", "ep-all-to-all")


def grad_final_points(actions: Sequence[Action]) -> set[tuple[Kind, int, int]]:
    """The actions of one rank after which a chunk's gradients are final, as (kind, stage,
    micro-batch): its last backward (B or BW) and, when its dW is deferred, its last W."""
    last: dict[tuple[int, str], Action] = {}
    for action in actions:
        for half in action.computes:
            if half.kind in (Kind.B, Kind.BW):
                last[(half.chunk, "backward")] = half
            elif half.kind is Kind.W:
                last[(half.chunk, "weight")] = half
    return {(a.kind, a.stage, a.microbatch) for a in last.values()}


def _collective(rank: int, kind: str, text: str) -> Issue:
    group = Comm(kind, (rank,), channel=False)
    return Issue((CommOp("collective", rank, group, ("collective", text)),))


def _rank_steps(rank: int, steps: list[Step], kinds: Sequence[str], training: bool) -> list[Step]:
    computes = [s.action for s in steps if isinstance(s, Compute)]
    final = grad_final_points(computes) if training else set()
    gathered: set[int] = set()
    out: list[Step] = []
    later: list[tuple] = []
    launched: dict[int, tuple] = {}  # chunk: its all-gather, issued at the step's start
    if "dp-all-gather" in kinds and training:
        chunks = sorted({h.chunk for a in computes for h in a.computes if h.kind is Kind.F})
        for chunk in chunks:
            issue = _collective(rank, "DP", f"data-parallel all-gather of chunk {chunk}")
            out.append(issue)
            launched[chunk] = issue.ops[0].key
    for step in steps:
        if isinstance(step, Compute):
            action = step.action
            if "dp-all-gather" in kinds:
                for half in action.computes:
                    if half.kind is Kind.F and half.chunk not in gathered:
                        gathered.add(half.chunk)
                        if half.chunk in launched:
                            out.append(Wait((launched[half.chunk],)))
                            continue
                        issue = _collective(rank, "DP", f"data-parallel all-gather in {half}")
                        out += [issue, Wait((issue.ops[0].key,))]
            if "ep-all-to-all" in kinds and action.kind is not Kind.W:
                issue = _collective(rank, "EP", f"expert-parallel all-to-all in {action}")
                out += [issue, Wait((issue.ops[0].key,))]
            if "dp-reduce-scatter" in kinds:
                for half in action.computes:
                    if (half.kind, half.stage, half.microbatch) in final:
                        text = f"data-parallel reduce-scatter of chunk {half.chunk} in {half}"
                        issue = _collective(rank, "DP", text)
                        out.append(issue)
                        later.append(issue.ops[0].key)
        out.append(step)
    if later:
        out.append(Wait(tuple(later)))
    return out


def with_collectives(plan: CommPlan, kinds: Sequence[str] = COLLECTIVES) -> CommPlan:
    """``plan`` with the collectives ``kinds`` put in where the step issues them (see
    docs/runtime.md, "Communication on NCCL"); for the NCCL model only: the executor
    never issues them."""
    unknown = sorted(set(kinds) - set(COLLECTIVES))
    if unknown:
        raise ScheduleError(
            f"unknown collective {unknown[0]!r}: use any of {', '.join(COLLECTIVES)}"
        )
    if not kinds:
        return plan
    training = not plan.forward_only
    ranks = [_rank_steps(r, steps, kinds, training) for r, steps in enumerate(plan.ranks)]
    return CommPlan(plan.schedule, ranks, plan.variable_shapes, plan.forward_only)
