"""The collectives a training step issues on other groups, where Megatron issues them.

A rank's data- and expert-parallel communicators take their streams from the same pool
as the pipeline's (see :mod:`.nccl_rules`): in the worst case all of them share one
stream, and a collective queued there behind a pipeline receive waits for it. The NCCL
model therefore runs a plan with these collectives put in at the points of the step where
Megatron-Core (0.16 to 0.19) issues them:

- ``dp-reduce-scatter`` (``overlap_grad_reduce``): DDP's backward hook marks each
  parameter's gradient ready outside ``no_sync`` only (``register_grad_ready``); once a
  bucket group is complete, ``start_grad_sync`` issues its reduce-scatter (an all-reduce
  without the distributed optimizer) without waiting. The Megatron adapter leaves
  ``no_sync`` only around a chunk's grad-final actions (:func:`grad_final_points`), so:
  issued in those computes, waited after the step (``finish_grad_sync``, from
  ``finalize_model_grads``).
- ``dp-all-gather`` (``overlap_param_gather`` with the distributed optimizer): in a
  training step the adapter calls ``param_sync_func`` (DDP's ``start_param_sync``) for
  every chunk at the step's start, as Megatron's interleaved schedule launches its first
  two chunks'; the forward pre-hook waits for the all-gather of the parameters it meets
  (``finish_param_sync``): issued at the start, in chunk order, waited in each chunk's
  first forward. In a forward-only step nobody launches it, and the pre-hook dispatches
  it itself: issued and waited in each chunk's first forward.
- ``ep-all-to-all``: the token dispatcher's dispatch and combine all-to-alls, issued and
  waited within every forward and backward of a MoE layer (under F&B overlap, combined
  1F1B's ``TransformerLayerSchedulePlan.run`` issues them on its communication stream
  inside the FB pair, the compute stream waiting through events): in every F, B, BW and
  FB (a W runs none).

Each is an operation on its rank's stream (:class:`~.comm_plan.CommOp` of kind
``collective``) of the communicator ``DP`` or ``EP``; the model completes it once it
reaches the head of that stream.
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
    """``plan`` with the collectives ``kinds`` put in where the step issues them (see the
    module docstring); for the NCCL model only: the executor never issues them."""
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
