"""A profile's per-layer costs laid over a training config's split (``simulate --profile
--config``). Pure Python.

Each model stage's F, B and W are its work in FLOPs (:func:`.model_cost.stage_costs`,
without recomputation: the profiled B already holds whatever the profiled run recomputed)
times the profile's milliseconds per FLOP of the same pass, found on one of the model's
layers (the first MoE layer, else the first): a stage of four MoE layers costs four
profiled layers, and the embedding, the output layer, the loss and the MTP block cost
their FLOPs at the layer's rate. The F&B pair's overlap is the profile's. Where the
config's split has no form over the schedule's number of model stages (first/last counts
made for PP stages, asked of 2 PP), the split is the most even one, as the advisor's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .advisor import PipelineSetup, stages_for
from .cost import CostModel
from .ir import Placement, ScheduleError
from .layer_split import stages_from_counts
from .model_cost import ModelShape, stage_costs
from .profile_trace import TraceCosts

__all__ = ["ConfigCosts", "config_costs"]


@dataclass(frozen=True)
class ConfigCosts:
    """A schedule's per-stage costs in ms: the split used (layout strings) and whether it
    is the config's own, the cost model, and the rates (ms per GFLOP of F, B, W)."""

    stages: tuple[str, ...]
    config_split: bool
    cost: CostModel
    rates: tuple[float, float, float]


def _even(num_layers: int, stages: int, mtp_layers: int) -> list[str]:
    base, extra = divmod(num_layers, stages)
    counts = [base + (1 if i < extra else 0) for i in range(stages)]
    return stages_from_counts(counts, mtp_layers)


def config_costs(
    profile: TraceCosts,
    shape: ModelShape,
    setup: PipelineSetup,
    placement: Placement,
    latency: float = 0.0,
) -> ConfigCosts:
    """The cost model of ``placement``'s model stages under the config's split, timed by
    ``profile`` (per-layer figures); :class:`ScheduleError` where the profile is not per
    layer."""
    if profile.unit != "layer":
        raise ScheduleError(
            f"--profile with --config needs per-layer phases (attn(F), mlp(B), ...); "
            f"{profile.path} has one span per pipeline action: simulate it without --config"
        )
    n = placement.num_model_stages
    try:
        stages, own = stages_for(shape, setup, n), True
    except ScheduleError:
        stages, own = _even(shape.num_layers, n, shape.mtp_layers), False
    tokens = setup.micro_batch_size * shape.seq_length
    tp = setup.tensor_model_parallel_size
    options = {
        "tokens": tokens,
        "tensor_parallel": tp,
        "sequence_parallel": setup.sequence_parallel,
        "expert_parallel": setup.expert_model_parallel_size,
    }
    costs = stage_costs(shape, stages, **options)
    layer = next((i for i in range(shape.num_layers) if shape.is_moe(i)), 0)
    work = shape.decoder_layer(layer)[0] * (tokens / tp)
    model = profile.cost_model()
    rates = tuple(
        ms / flops if flops else 0.0
        for ms, flops in ((model.f, work.f), (model.b, work.b), (model.w, work.w))
    )
    stage_ms = tuple((c.f * rates[0], c.b * rates[1], c.w * rates[2]) for c in costs)
    cost = CostModel(
        stage_costs=stage_ms,
        overlap=model.overlap,
        latency=latency,
        a2a_f=model.a2a_f,
        a2a_b=model.a2a_b,
    )
    return ConfigCosts(tuple(stages), own, cost, tuple(r * 1e9 for r in rates))
