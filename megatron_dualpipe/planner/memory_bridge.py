"""Our per-rank memory beside Megatron-LM's own estimate, term by term. Pure Python.

:func:`bridges` takes the two figures of Megatron-LM's ``theoretical_memory_usage.py`` for a
config under 1F1B (the most loaded rank's weights, gradients and optimizer states; the
first stage's activations) and walks from each to ours (:mod:`.memory`) in named steps,
each computed from our model: what the formula assumes that this config does not, and what
it leaves out. What remains, ``residual``, is where the two disagree on the same quantity;
the tests hold it under :data:`TOLERANCE`. The steps, and a worked example:
docs/memory.md, "Beside Megatron-LM's own formula".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..schedules.ir import Schedule, ScheduleError
from ..schedules.layout import DECODER, LOSS, MTP
from .memory import MemoryModel, MemorySettings
from .model_cost import ModelShape

__all__ = ["TOLERANCE", "Bridge", "BridgeStep", "bridges"]

#: The largest relative residual the tests accept between Megatron-LM's figure plus our
#: named steps and our figure.
TOLERANCE = 1e-3


@dataclass(frozen=True)
class BridgeStep:
    """One named difference, in bytes (negative: the formula counts it, ours does not)."""

    label: str
    bytes: float


@dataclass(frozen=True)
class Bridge:
    """From Megatron-LM's figure to ours for one quantity on one rank."""

    what: str
    rank: int
    megatron: float
    steps: tuple[BridgeStep, ...]
    ours: float

    @property
    def residual(self) -> float:
        """(Megatron's figure + the steps - ours) / ours."""
        return (self.megatron + sum(s.bytes for s in self.steps) - self.ours) / self.ours


def _standard(shape: ModelShape) -> ModelShape:
    """The layer the activation formula assumes: dense, multi-head attention, a 4h MLP."""
    return dataclasses.replace(
        _multi_head(shape),
        num_experts=None,
        moe_shared_expert_intermediate_size=None,
        moe_layer_freq=1,
        ffn_hidden_size=4 * shape.hidden_size,
        swiglu=False,
    )


def _multi_head(shape: ModelShape) -> ModelShape:
    """``shape`` with multi-head attention in place of MLA (same heads and width)."""
    return dataclasses.replace(
        shape,
        multi_latent_attention=False,
        q_lora_rank=None,
        kv_channels=None,
        num_query_groups=None,
    )


def bridges(
    shape: ModelShape,
    setup: object,
    schedule: Schedule,
    stages: list[str],
    settings: MemorySettings,
    *,
    megatron_weights: float,
    megatron_activations: float,
) -> list[Bridge]:
    """The two bridges (weights, gradients and optimizer states on the last rank, which
    holds the MTP block; activations on the first) for ``setup`` (the advisor's
    ``ParallelSetup``, bf16 Adam, no sequence parallelism) under the 1F1B ``schedule`` with
    the config's ``stages``."""
    if schedule.name != "1f1b":
        raise ScheduleError("Megatron-LM's memory formula is for 1F1B: bridge a 1f1b schedule")
    if not setup.bf16 or setup.optimizer != "adam" or setup.sequence_parallel:
        raise ScheduleError(
            "the bridge follows Megatron-LM's formula for bf16 Adam without sequence "
            "parallelism: set bf16, optimizer adam and sequence_parallel false"
        )
    return [
        _weights_bridge(shape, setup, schedule, stages, settings, megatron_weights),
        _activations_bridge(shape, setup, schedule, stages, settings, megatron_activations),
    ]


def _weights_bridge(shape, setup, schedule, stages, settings, megatron: float) -> Bridge:
    model = MemoryModel.for_setup(shape, setup, schedule, settings)
    rank = schedule.placement.num_ranks - 1
    mine = model.ranks(stages)[rank]
    dp, ep, tp = setup.data_parallel_size, setup.expert_model_parallel_size, model.tp
    weight, grad, opt, plain = model.bytes_per_parameter(dp)
    e_weight, e_grad, e_opt, e_plain = model.bytes_per_parameter(max(1, dp // ep))
    dense_b = weight + grad + (opt if model.distributed else plain)
    expert_b = e_weight + e_grad + (e_opt if model.distributed else e_plain)

    unbiased = MemoryModel.for_setup(
        dataclasses.replace(shape, add_bias_linear=False), setup, schedule, settings
    )

    def layer_bytes(layer: int, of: MemoryModel = model) -> float:
        one = of.stage(DECODER, layer)  # its parameters on one rank (norms, router whole)
        return one.dense * dense_b + one.expert * expert_b

    def bias_bytes(layer: int) -> float:
        return layer_bytes(layer) - layer_bytes(layer, unbiased)

    n, p, h = shape.num_layers, schedule.placement.num_ranks, shape.hidden_size
    held = stages[rank]
    first = sum(s.count(DECODER) for s in stages[:rank])
    on_rank = sum(layer_bytes(first + i) for i in range(held.count(DECODER)))
    average = sum(layer_bytes(i) for i in range(n)) / p
    norm = h * (1 if shape.normalization == "RMSNorm" else 2)
    table = shape.vocab_size * h / tp
    part = model.stage(held, first)
    tables = part.embedding_table + part.output_table
    biases = sum(bias_bytes(i) for i in range(n)) / p
    steps = [
        BridgeStep(
            "the biases of the formula's average layers (add_bias_linear), which it leaves out",
            biases,
        ),
        BridgeStep(
            f"this split's {held.count(DECODER)} decoder layers on the rank in place of the "
            f"formula's average {n}/{p} = {n / p:.4g}",
            on_rank - average,
        ),
        BridgeStep(
            "the final norm whole on the loss's rank (the formula spreads it over the stages)",
            norm * (1 - 1 / p) * dense_b if LOSS in held else -norm / p * dense_b,
        ),
        BridgeStep(
            "each MTP layer's own eh_proj (2h x h), three norms and its layer's biases, not in "
            "the formula",
            held.count(MTP) * ((2 * h * h / tp + 3 * norm) * dense_b + bias_bytes(n - 1)),
        ),
        BridgeStep(
            f"{tables} vocabulary table(s) on the rank (the MTP block keeps its own copy of "
            "the embedding beside the output layer) where the formula counts one",
            (tables - 1) * table * dense_b,
        ),
    ]
    if shape.position_embedding_type == "learned_absolute" and part.embedding_table:
        positions = (shape.max_position_embeddings or shape.seq_length) * h
        steps.append(
            BridgeStep(
                "learned position embeddings of the rank's embedding copy, not in the formula",
                positions * dense_b,
            )
        )
    if model.fp8:
        steps.append(
            BridgeStep(
                "Transformer Engine's two cached FP8 copies of each linear weight (FP8)",
                2 * part.linear_weights,
            )
        )
    ours = mine.weights + mine.gradients + mine.optimizer
    return Bridge("weights, gradients and optimizer states", rank, megatron, tuple(steps), ours)


def _activations_bridge(shape, setup, schedule, stages, settings, megatron: float) -> Bridge:
    s, b, h = shape.seq_length, setup.micro_batch_size, shape.hidden_size
    n, p, tp = shape.num_layers, schedule.placement.num_ranks, setup.tensor_model_parallel_size
    in_flight = min(1.0, setup.num_microbatches / p) * p

    def peak(variant: ModelShape, with_settings: MemorySettings) -> float:
        model = MemoryModel.for_setup(variant, setup, schedule, with_settings)
        first = model.ranks(stages)[0]
        return first.activations + first.recompute

    plain = MemorySettings()
    standard = peak(_standard(shape), plain)
    multi_head = peak(_multi_head(shape), plain)
    actual = peak(shape, plain)
    recomputed = peak(shape, dataclasses.replace(settings, fp8=None))
    ours = peak(shape, settings)
    layers_0 = stages[0].count(DECODER)
    stats = 4 * shape.num_attention_heads / tp * s * b
    without_allowance = megatron / 1.05
    steps = [
        BridgeStep(
            "the formula's 5% allowance for temporaries, not in ours",
            without_allowance - megatron,
        ),
        BridgeStep(
            f"token ids (int64) and the embedding's dropout mask of {in_flight:g} micro-batches "
            "in flight, not saved here",
            -(8 * s * b + s * b * h) * in_flight,
        ),
        BridgeStep(
            f"dropout masks after attention and MLP in the formula's {n} layers "
            "(2 sbh; dropout is off in training configs here)",
            -2 * s * b * h * n * in_flight / p,
        ),
        BridgeStep(
            "flash attention's softmax statistics (fp32 per head and token), left out by the "
            "formula",
            stats * n * in_flight / p,
        ),
        BridgeStep(
            f"the first stage's {layers_0} decoder layers in place of the formula's average "
            f"{n}/{p} = {n / p:.4g}, each as the formula's dense multi-head layer",
            standard - (standard / layers_0) * n / p if layers_0 else -0.0,
        ),
        BridgeStep(
            "this model's MLP or MoE in place of a dense 4h MLP (its width, SwiGLU, the "
            "routed top-k copies, router probabilities, shared expert)",
            multi_head - standard,
        ),
        BridgeStep("multi-latent attention in place of multi-head attention", actual - multi_head),
        BridgeStep(
            f"{dataclasses.replace(settings, fp8=None).describe().removeprefix('no FP8, ')}: "
            "what recomputation drops, and the largest layer rebuilt inside a B",
            recomputed - actual,
        ),
        BridgeStep("FP8 storage of linear layers' inputs", ours - recomputed),
    ]
    return Bridge("activations", 0, megatron, tuple(steps), ours)
