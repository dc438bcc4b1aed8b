"""What ``simulate --profile`` and the benchmark (``bench/`` in the checkout) compare: the
schedules (ours, Megatron's, torch.distributed.pipelining's imported into our IR)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..schedules import Action, Kind, Schedule, generate
from .torch_schedules import import_torch_schedule

__all__ = [
    "SCHEDULES",
    "VIRTUAL_STAGES",
    "ScheduleEntry",
    "steady_state_pairs",
]


@dataclass(frozen=True)
class ScheduleEntry:
    """A schedule by name, where it comes from (``ours``, ``megatron`` or ``torch``) and its
    builder ``build(ranks, microbatches) -> Schedule`` (raises ScheduleError where not
    legal); ``variants``: its builds by label (``build`` the first) where a comparison on
    real costs tries several and keeps the fastest (Megatron's interleaved 1F1B at 2 to 4
    virtual stages per rank)."""

    name: str
    source: str
    build: Callable[[int, int], Schedule]
    variants: tuple[tuple[str, Callable[[int, int], Schedule]], ...] = ()


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


#: Virtual stages per rank Megatron's interleaved 1F1B is tried at on real costs (its
#: DeepSeek-V3 recipes use 2 to 4); the table's first.
VIRTUAL_STAGES = (2, 3, 4)


def _megatron_a2a(name: str) -> ScheduleEntry:
    def at(chunks: int) -> Callable[[int, int], Schedule]:
        def build(ranks: int, microbatches: int) -> Schedule:
            interleaved = generate("interleaved-1f1b", ranks, microbatches, chunks=chunks)
            return steady_state_pairs(interleaved, name)

        return build

    builds = tuple((f"VP={k}", at(k)) for k in VIRTUAL_STAGES)
    return ScheduleEntry(name, "megatron", builds[0][1], builds)


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
