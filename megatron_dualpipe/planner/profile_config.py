"""A profile's per-layer costs laid over a training config's split (``simulate --profile
--config``). Pure Python.

Each model stage's F, B and W compute is its FLOPs (:func:`.model_cost.stage_costs`,
without recomputation) at the profile's compute milliseconds per FLOP of the same pass,
found on one of the model's layers; its all-to-all is its MoE layers' FLOPs at that layer's
all-to-all milliseconds per FLOP. How, and why: docs/schedules.md, "The simulator" (costs
from a profile).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..schedules.cost import CostModel
from ..schedules.ir import Placement, ScheduleError
from ..schedules.layer_split import stages_from_counts
from .advisor import ParallelSetup, StageTiming, even_counts, stages_for
from .model_cost import ModelShape, stage_costs
from .profile_trace import TraceCosts

__all__ = ["ConfigCosts", "config_costs", "profile_timing", "timed_costs"]


@dataclass(frozen=True)
class ConfigCosts:
    """A schedule's per-stage costs in ms: the split used (layout strings) and which it
    is (``split``: "config's", "most even" or "advised"), and the cost model."""

    stages: tuple[str, ...]
    split: str
    cost: CostModel

    @property
    def config_split(self) -> bool:
        return self.split == "config's"


def _options(setup: ParallelSetup, shape: ModelShape) -> dict:
    return {
        "tokens": setup.micro_batch_size * shape.seq_length,
        "tensor_parallel": setup.tensor_model_parallel_size,
        "sequence_parallel": setup.sequence_parallel,
        "expert_parallel": setup.expert_model_parallel_size,
    }


def profile_timing(profile: TraceCosts, shape: ModelShape, setup: ParallelSetup) -> StageTiming:
    """The profile's compute milliseconds per FLOP of each pass, found on one of the
    model's layers (the first MoE layer, else the first), and its all-to-all's per FLOP
    of that MoE layer (none in a model without MoE layers); :class:`ScheduleError` where
    the profile is not per layer."""
    if profile.unit != "layer":
        raise ScheduleError(
            f"--profile with --config needs per-layer phases (attn(F), mlp(B), ...); "
            f"{profile.path} has one span per pipeline action: simulate it without --config"
        )
    options = _options(setup, shape)
    moe = next((i for i in range(shape.num_layers) if shape.is_moe(i)), None)
    work = shape.decoder_layer(moe or 0)[0] * (options["tokens"] / options["tensor_parallel"])
    rates = tuple(
        ms / flops if flops else 0.0
        for ms, flops in ((profile.f, work.f), (profile.b, work.b), (profile.w, work.w))
    )
    a2a_rates = (0.0, 0.0)
    if moe is not None:
        a2a_rates = (
            profile.a2a_forward / work.f if work.f else 0.0,
            profile.a2a_backward / work.b if work.b else 0.0,
        )
    return StageTiming(rates, a2a_rates)


def timed_costs(
    timing: StageTiming,
    shape: ModelShape,
    setup: ParallelSetup,
    stages: Sequence[str],
    split: str,
    latency: float = 0.0,
) -> ConfigCosts:
    """``stages`` (layout strings in pipeline order) timed by ``timing``."""
    costs = [timing.timed(c) for c in stage_costs(shape, list(stages), **_options(setup, shape))]
    cost = replace(timing.cost_model(costs), latency=latency)
    return ConfigCosts(tuple(stages), split, cost)


def config_costs(
    timing: StageTiming,
    shape: ModelShape,
    setup: ParallelSetup,
    placement: Placement,
    latency: float = 0.0,
) -> ConfigCosts:
    """The cost model of ``placement``'s model stages under the config's split (the most
    even where it has no form over them), timed by ``timing`` (:func:`profile_timing`)."""
    n = placement.num_model_stages
    try:
        stages, split = stages_for(shape, setup, n), "config's"
    except ScheduleError:
        counts = even_counts(shape.num_layers, n)
        stages, split = stages_from_counts(counts, shape.mtp_layers), "most even"
    return timed_costs(timing, shape, setup, stages, split, latency)
