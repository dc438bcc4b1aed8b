"""Import torch.distributed.pipelining's schedules into our IR, so that PyTorch's own
schedules can be validated, simulated and compared like ours.

torch's schedule visualiser helper (``_schedule_visualizer.get_schedule_ops``) builds a
schedule class through its own constructor on stand-in stages, so torch itself validates
the parameters, and returns every rank's compute order. Idle slots (None), bookkeeping
(REDUCE_GRAD, UNSHARD, RESHARD, and from torch 2.15 WAIT_REDUCE_GRAD) and communication
(SEND/RECV, torch 2.15's WAIT_SEND_F/B) are dropped; communication is added, if wanted, by
our own lowering. An action type torch adds later is refused in one sentence naming it.

Contract: for each schedule in :data:`TORCH_SCHEDULES` and any (ranks, micro-batches)
torch itself accepts, :func:`import_torch_schedule` returns a schedule our ``validate()``
accepts; what torch refuses is a :class:`ScheduleError` with torch's reason. torch is
imported only when a schedule is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules.ir import Action, Kind, Placement, Schedule, ScheduleError

__all__ = [
    "TORCH_SCHEDULES",
    "TorchScheduleSpec",
    "from_torch_pipelining",
    "import_torch_schedule",
]

_KINDS = {
    "FORWARD": Kind.F,
    "BACKWARD_INPUT": Kind.B,
    "BACKWARD_WEIGHT": Kind.W,
    "FULL_BACKWARD": Kind.BW,
    "OVERLAP_F_B": Kind.FB,
}
# Actions that do no pipeline compute: gradient reduction, FSDP (un)sharding, messages.
_SKIPPED = frozenset(
    {"REDUCE_GRAD", "WAIT_REDUCE_GRAD", "UNSHARD", "RESHARD"}
    | {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "WAIT_SEND_F", "WAIT_SEND_B"}
)


@dataclass(frozen=True)
class TorchScheduleSpec:
    """One torch schedule class and how its stages are laid out.

    ``placement`` is ``loop`` (stage s on rank ``s % R``) or ``v``; ``chunks`` is the number
    of stages per rank (None: the caller chooses, default 2)."""

    class_name: str
    placement: str
    chunks: int | None

    def chunks_for(self, chunks: int | None) -> int:
        if self.chunks is None:
            return 2 if chunks is None else chunks
        if chunks not in (None, self.chunks):
            raise ScheduleError(f"{self.class_name} runs exactly {self.chunks} stage(s) per rank")
        return self.chunks


#: Our names for the torch schedules we import.
TORCH_SCHEDULES: dict[str, TorchScheduleSpec] = {
    "torch-1f1b": TorchScheduleSpec("Schedule1F1B", "loop", 1),
    "torch-interleaved-1f1b": TorchScheduleSpec("ScheduleInterleaved1F1B", "loop", None),
    "torch-interleaved-zb": TorchScheduleSpec("ScheduleInterleavedZeroBubble", "loop", None),
    "torch-zbv": TorchScheduleSpec("ScheduleZBVZeroBubble", "v", 2),
    "torch-dualpipev": TorchScheduleSpec("ScheduleDualPipeV", "v", 2),
}


def _convert(action, placement: Placement) -> Action:
    name = action.computation_type.name
    kind = _KINDS.get(name)
    if kind is None:
        known = ", ".join([*_KINDS, *sorted(_SKIPPED)])
        raise ScheduleError(
            f"torch's schedule uses the action type {name}, which megatron-dualpipe does not "
            f"know (it knows {known}): import the schedule with a torch it knows (2.6 to 2.15)"
        )
    if kind is Kind.FB:
        forward, backward = (_convert(a, placement) for a in action.sub_actions)
        return Action.overlapped(forward, backward)
    stage = action.stage_index
    return Action(kind, stage, action.microbatch_index, placement.chunk_of(stage))


def _renumber_forwards(ops: list) -> list:
    """Label each stage's forwards 0, 1, 2, ... in issue order.

    ``Schedule1F1B._get_pipeline_order`` (a description of what ``_step_microbatches``
    runs) labels the last rank's forwards 1..M instead of 0..M-1; the runtime itself
    forwards micro-batches in order, which this restores."""
    count: dict[int, int] = {}
    out = []
    for a in ops:
        if a is not None and a.computation_type.name == "FORWARD":
            k = count.get(a.stage_index, 0)
            count[a.stage_index] = k + 1
            a = a._replace(microbatch_index=k)
        out.append(a)
    return out


def from_torch_pipelining(
    schedule_cls: type, num_ranks: int, num_microbatches: int, placement: Placement, name: str
) -> Schedule:
    """Build ``schedule_cls`` (through torch's own constructor, on stand-in stages) and
    return its compute order as a :class:`Schedule` on ``placement``.

    ``placement`` must be the one torch uses for that class (``loop`` for 1F1B and the
    interleaved schedules, ``v`` for ZBV and DualPipeV); a mismatch shows up in
    ``validate()`` as a stage on the wrong rank."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    try:
        orders = get_schedule_ops(
            schedule_cls, num_ranks, num_microbatches, num_stages_per_rank=placement.num_chunks
        )
    except (ValueError, AssertionError) as err:
        reason = " ".join(str(err).split())
        raise ScheduleError(
            f"torch's {schedule_cls.__name__} refuses PP={num_ranks} with {num_microbatches} "
            f"micro-batches: {reason}"
        ) from None
    if placement.num_chunks == 1:  # single-stage schedules describe their order loosely
        orders = [_renumber_forwards(ops) for ops in orders]
    ranks = [
        [
            _convert(a, placement)
            for a in ops
            if a is not None and a.computation_type.name not in _SKIPPED
        ]
        for ops in orders
    ]
    return Schedule(name, placement, ranks)


def import_torch_schedule(
    name: str, num_ranks: int, num_microbatches: int, chunks: int | None = None
) -> Schedule:
    """Import the torch schedule registered as ``name`` in :data:`TORCH_SCHEDULES`
    (``chunks``: stages per rank, for the interleaved ones; default 2)."""
    spec = TORCH_SCHEDULES.get(name)
    if spec is None:
        raise ScheduleError(
            f"unknown torch schedule {name!r}: choose one of {', '.join(TORCH_SCHEDULES)}"
        )
    if num_ranks < 1 or num_microbatches < 1:
        raise ScheduleError("a schedule needs at least one rank and one micro-batch")
    per_rank = spec.chunks_for(chunks)
    placement = Placement(spec.placement, num_ranks, per_rank * num_ranks, num_microbatches)
    from torch.distributed.pipelining import schedules

    return from_torch_pipelining(
        getattr(schedules, spec.class_name), num_ranks, num_microbatches, placement, name
    )
