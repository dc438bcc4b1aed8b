"""What the benchmarks compare: the schedules (ours and torch.distributed.pipelining's,
imported into our IR) and the cost profiles.

Costs in a profile are for one rank's share of the model (one 1F1B stage); a benchmark
converts them with :meth:`CostModel.per_stage` so that schedules with more, smaller stages
are compared at equal model size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..schedules import Action, CostModel, Kind, Schedule, generate
from .torch_schedules import import_torch_schedule

__all__ = [
    "PROFILES",
    "SCHEDULES",
    "Profile",
    "ScheduleEntry",
    "per_stage_cost",
    "steady_state_pairs",
]


@dataclass(frozen=True)
class ScheduleEntry:
    """A schedule by name, where it comes from (``ours`` or ``torch``) and its builder
    ``build(ranks, microbatches) -> Schedule`` (raises ScheduleError where not legal)."""

    name: str
    source: str
    build: Callable[[int, int], Schedule]


@dataclass(frozen=True)
class Profile:
    """A named cost model; ``key`` is a file-name-safe identifier."""

    key: str
    label: str
    cost: CostModel


def _ours(name: str, **options: int) -> ScheduleEntry:
    return ScheduleEntry(name, "ours", lambda r, m: generate(name, r, m, **options))


def _torch(name: str) -> ScheduleEntry:
    return ScheduleEntry(name, "torch", lambda r, m: import_torch_schedule(name, r, m))


def steady_state_pairs(schedule: Schedule, name: str) -> Schedule:
    """``schedule`` with every forward that is directly followed by a full backward issued
    together with it, as one FB action: what Megatron's interleaved 1F1B does in its steady
    state with ``overlap_moe_expert_parallel_comm`` (combined_1f1b)."""
    ranks = []
    for actions in schedule.ranks:
        paired: list[Action] = []
        for action in actions:
            last = paired[-1] if paired else None
            if action.kind is Kind.BW and last is not None and last.kind is Kind.F:
                paired[-1] = Action.overlapped(last, action)
            else:
                paired.append(action)
        ranks.append(paired)
    return Schedule(name, schedule.placement, ranks, schedule.activation_bound)


def _megatron_a2a(name: str) -> ScheduleEntry:
    def build(ranks: int, microbatches: int) -> Schedule:
        interleaved = generate("interleaved-1f1b", ranks, microbatches, chunks=2)
        return steady_state_pairs(interleaved, name)

    return ScheduleEntry(name, "megatron", build)


#: In table order; the first is the baseline for "vs 1F1B".
SCHEDULES: tuple[ScheduleEntry, ...] = (
    _ours("1f1b"),
    _ours("interleaved-1f1b", chunks=2),
    # Megatron's own interleaved 1F1B with its MoE all-to-all overlap: the honest peer.
    _megatron_a2a("interleaved-1f1b-a2a"),
    _ours("zb1p"),
    _ours("dualpipe"),
    _ours("dualpipev"),
    _torch("torch-1f1b"),
    _torch("torch-interleaved-zb"),
    _torch("torch-zbv"),
    _torch("torch-dualpipev"),
)

PROFILES: tuple[Profile, ...] = (
    Profile("equal", "F=B=W", CostModel(f=1.0, b=1.0, w=1.0)),
    Profile("w-half", "W=0.5B", CostModel(f=1.0, b=1.0, w=0.5)),
    # An F&B pair of a forward and a full backward takes 0.7 x (F+B+W): MoE-style overlap
    # of one micro-batch's all-to-all with another's compute.
    Profile("moe-overlap", "F&B=0.7(F+B+W)", CostModel(f=1.0, b=1.0, w=1.0, overlap=0.7)),
)


def per_stage_cost(cost: CostModel, schedule: Schedule) -> CostModel:
    """``cost`` (per rank share) as the cost of one of ``schedule``'s stages."""
    p = schedule.placement
    return cost.per_stage(p.num_ranks, p.num_model_stages)
