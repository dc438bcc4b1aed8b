"""The benchmark's cost profiles. Costs in a profile are for one rank's share of the model
(one 1F1B stage); :meth:`Profile.cost_for` divides them among a placement's model stages, so
that schedules with more, smaller stages are compared at equal model size."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_dualpipe.schedules import CostModel, Placement

__all__ = ["PROFILES", "Profile"]


@dataclass(frozen=True)
class Profile:
    """A named cost model; ``key`` is a file-name-safe identifier. ``end_scale``
    multiplies the first and the last model stage's costs (the embedding; the output
    layer and the loss): under the V placement both are rank 0's, under a loop the first
    and the last rank's, under the mirror each end rank holds one end of each copy."""

    key: str
    label: str
    cost: CostModel
    end_scale: float = 1.0

    def cost_for(self, placement: Placement) -> CostModel:
        """This profile's costs for one of ``placement``'s stages (per rank share in the
        profile, divided among the placement's model stages)."""
        cost = self.cost.per_stage(placement.num_ranks, placement.num_model_stages)
        if self.end_scale == 1.0:
            return cost
        n = placement.num_model_stages
        scale = tuple(self.end_scale if s in (0, n - 1) else 1.0 for s in range(n))
        return replace(cost, stage_scale=scale)


PROFILES: tuple[Profile, ...] = (
    Profile("equal", "F=B=W", CostModel(f=1.0, b=1.0, w=1.0)),
    Profile("w-half", "W=0.5B", CostModel(f=1.0, b=1.0, w=0.5)),
    # An F&B pair of a forward and a full backward takes 0.7 x (F+B+W): MoE-style overlap
    # of one micro-batch's all-to-all with another's compute.
    Profile("moe-overlap", "F&B=0.7(F+B+W)", CostModel(f=1.0, b=1.0, w=1.0, overlap=0.7)),
    # Embedding, output layer and loss make the stages at the ends 1.5x their share.
    Profile("uneven", "ends 1.5x", CostModel(f=1.0, b=1.0, w=1.0), end_scale=1.5),
    # Every point-to-point message takes 5% of a rank share's forward.
    Profile("latency", "P2P latency 5% of F", CostModel(f=1.0, b=1.0, w=1.0, latency=0.05)),
)
