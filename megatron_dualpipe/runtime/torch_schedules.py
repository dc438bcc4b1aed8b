"""Import torch.distributed.pipelining's schedule generators into our IR, so that PyTorch's
own schedules can be validated, simulated and compared like ours."""

from __future__ import annotations

from ..schedules.ir import Action, Kind, Placement, Schedule

__all__ = ["from_torch_pipelining"]

_KINDS = {
    "FORWARD": Kind.F,
    "BACKWARD_INPUT": Kind.B,
    "BACKWARD_WEIGHT": Kind.W,
    "FULL_BACKWARD": Kind.BW,
    "OVERLAP_F_B": Kind.FB,
}


def _convert(action, placement: Placement) -> Action:
    kind = _KINDS[action.computation_type.name]
    if kind is Kind.FB:
        forward, backward = (_convert(a, placement) for a in action.sub_actions)
        return Action.overlapped(forward, backward)
    stage = action.stage_index
    return Action(kind, stage, action.microbatch_index, placement.chunk_of(stage))


def from_torch_pipelining(
    schedule_cls: type, num_ranks: int, num_microbatches: int, placement: Placement, name: str
) -> Schedule:
    """Run ``schedule_cls``'s per-rank generator (no process group, no stages) and return its
    compute order as a :class:`Schedule` on ``placement``."""
    generator = object.__new__(schedule_cls)
    generator.pp_group_size = num_ranks
    generator._n_microbatches = num_microbatches
    generator._num_stages = placement.num_stages
    generator.n_local_stages = placement.num_chunks
    ranks = []
    for rank in range(num_ranks):
        ops = generator._calculate_single_rank_operations(rank)
        ranks.append([_convert(a, placement) for a in ops if a is not None])
    return Schedule(name, placement, ranks)
