"""Import torch.distributed.pipelining's schedule generators into our IR, so that PyTorch's
own schedules can be validated, simulated and compared like ours.

Each torch schedule class computes every rank's compute order in plain Python
(``_calculate_single_rank_operations`` for the multi-stage runtimes, ``_get_pipeline_order``
for :class:`Schedule1F1B`); its constructor would also build process groups and stages,
so the generator runs on an instance made with ``object.__new__`` carrying only the
attributes the generator reads. The result is the compute-only order: idle slots (None)
and bookkeeping actions (REDUCE_GRAD, UNSHARD, RESHARD) are dropped; communication is
added, if wanted, by our own lowering.

Contract: for each schedule in :data:`TORCH_SCHEDULES` and any (ranks, micro-batches)
torch itself accepts, :func:`import_torch_schedule` returns a schedule our ``validate()``
accepts; parameters torch would refuse raise :class:`ScheduleError` before any import
work. torch is imported only when a schedule is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules.ir import Action, Kind, Placement, Schedule, ScheduleError

__all__ = [
    "TORCH_SCHEDULES",
    "TorchScheduleSpec",
    "as_torch_runs",
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
# Actions that do no pipeline compute: gradient reduction and FSDP (un)sharding.
_SKIPPED = frozenset({"REDUCE_GRAD", "UNSHARD", "RESHARD"})


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
    kind = _KINDS[action.computation_type.name]
    if kind is Kind.FB:
        forward, backward = (_convert(a, placement) for a in action.sub_actions)
        return Action.overlapped(forward, backward)
    stage = action.stage_index
    return Action(kind, stage, action.microbatch_index, placement.chunk_of(stage))


def _check_accepted(class_name: str, ranks: int, microbatches: int, stages: int) -> None:
    """Refuse what torch's constructors refuse (they are not run here)."""
    if ranks < 1 or microbatches < 1:
        raise ScheduleError("a schedule needs at least one rank and one micro-batch")
    if class_name == "Schedule1F1B" and microbatches < stages:
        raise ScheduleError(
            f"torch's Schedule1F1B needs at least as many micro-batches as stages ({stages}), "
            f"got {microbatches}"
        )
    if class_name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            raise ScheduleError(
                f"torch's {class_name} needs micro-batches ({microbatches}) divisible by "
                f"max(1, micro-batches // PP) = {rounds}: use a multiple of PP"
            )
    if class_name == "ScheduleDualPipeV" and microbatches < stages:
        raise ScheduleError(
            f"torch's ScheduleDualPipeV needs at least 2 x PP = {stages} micro-batches, got "
            f"{microbatches}"
        )


def _generator(schedule_cls: type, ranks: int, microbatches: int, placement: Placement):
    """An instance of ``schedule_cls`` holding only what its generator reads."""
    gen = object.__new__(schedule_cls)
    gen.pp_group_size = ranks
    gen._n_microbatches = microbatches
    gen._num_stages = gen.num_stages = placement.num_stages
    gen.n_local_stages = placement.num_chunks
    gen.number_of_rounds = max(1, microbatches // ranks)
    gen.microbatches_per_round = microbatches // gen.number_of_rounds
    return gen


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
    """Run ``schedule_cls``'s per-rank generator (no process group, no stages) and return its
    compute order as a :class:`Schedule` on ``placement``.

    ``placement`` must be the one torch uses for that class (``loop`` for 1F1B and the
    interleaved schedules, ``v`` for ZBV and DualPipeV); a mismatch shows up in
    ``validate()`` as a stage on the wrong rank."""
    _check_accepted(schedule_cls.__name__, num_ranks, num_microbatches, placement.num_stages)
    gen = _generator(schedule_cls, num_ranks, num_microbatches, placement)
    if hasattr(schedule_cls, "_calculate_single_rank_operations"):
        orders = [gen._calculate_single_rank_operations(rank) for rank in range(num_ranks)]
    else:  # single-stage schedules build every rank's order at once
        everyone = gen._get_pipeline_order()
        orders = [_renumber_forwards(everyone[rank]) for rank in range(num_ranks)]
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
    per_rank = spec.chunks_for(chunks)
    placement = Placement(spec.placement, num_ranks, per_rank * num_ranks, num_microbatches)
    try:
        from torch.distributed.pipelining import schedules
    except ImportError as err:  # pragma: no cover - torch is a declared dependency
        raise ScheduleError(f"importing {name} needs torch.distributed.pipelining: {err}") from err
    return from_torch_pipelining(
        getattr(schedules, spec.class_name), num_ranks, num_microbatches, placement, name
    )


def as_torch_runs(schedule: Schedule) -> Schedule:
    """The order torch's runtime really executes: its first stage (stage 0, whose input
    needs no gradient) skips the dX pass and runs the whole backward at its W. Each stage-0
    B is dropped and its W becomes a BW; everything else is unchanged."""
    ranks = []
    for actions in schedule.ranks:
        out = []
        for a in actions:
            if a.stage == 0 and a.kind is Kind.B:
                continue
            if a.stage == 0 and a.kind is Kind.W:
                a = a._replace(kind=Kind.BW)
            out.append(a)
        ranks.append(out)
    return Schedule(f"{schedule.name} (as run)", schedule.placement, ranks)
