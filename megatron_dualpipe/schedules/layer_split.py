"""How many decoder layers each model stage holds, from Megatron's own split settings.

Megatron-Core cuts ``num_layers`` into pipeline stages evenly unless told otherwise:
``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` (Megatron-LM's
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``) fix the
first and last stage and split the rest evenly; ``account_for_embedding_in_pipeline_split``
/ ``account_for_loss_in_pipeline_split`` count the embedding / the loss as one layer of the
first / last stage. Our schedules read these over their *model stages in pipeline order*:
the stage where data enters (the embedding) is first, the stage that ends in the loss is
last. Under dualpipev that is 2 x PP stages in the V (rank r holds stage r and stage
2P-1-r, so the first and the last stage are both on rank 0); under dualpipe PP stages
(each held twice); under 1f1b and zb1p PP stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import ScheduleError
from .layout import DECODER, EMBEDDING, LOSS, MTP, check_layout, format_layout, parse_layout

__all__ = [
    "LayerSplit",
    "UnevenSplit",
    "even_layout",
    "stage_layer_counts",
    "stage_layouts",
    "stages_from_counts",
]


class UnevenSplit(ScheduleError):
    """The decoder layers do not split evenly over the stages the settings leave them."""


@dataclass(frozen=True)
class LayerSplit:
    """Megatron's split settings (see the module docstring); ``None`` means even."""

    num_layers: int
    first: int | None = None
    last: int | None = None
    account_for_embedding: bool = False
    account_for_loss: bool = False


def stage_layer_counts(split: LayerSplit, model_stages: int) -> list[int]:
    """Decoder layers of each of ``model_stages`` stages, first (embedding) to last (loss),
    as Megatron-Core computes them; :class:`ScheduleError` with the fix where they do not
    split."""
    if model_stages < 1:
        raise ScheduleError("a model needs at least one stage")
    uneven = split.first is not None or split.last is not None
    if uneven and (split.account_for_embedding or split.account_for_loss):
        raise ScheduleError(
            "first/last stage layer counts cannot be combined with accounting for the "
            "embedding or the loss in the pipeline split (as in Megatron-Core): use one of them"
        )
    if uneven:
        return _uneven(split, model_stages)
    total = split.num_layers + split.account_for_embedding + split.account_for_loss
    if total % model_stages:
        extra = " (with the embedding and loss counted as layers)" * (total != split.num_layers)
        raise UnevenSplit(
            f"{split.num_layers} layers{extra} do not split evenly into {model_stages} stages: "
            f"use a multiple of {model_stages}, or set the first/last stage layer counts"
        )
    counts = [total // model_stages] * model_stages
    counts[0] -= split.account_for_embedding
    counts[-1] -= split.account_for_loss
    if min(counts) < 0:
        raise ScheduleError("a stage would hold a negative number of layers: add layers")
    return counts


def stage_layouts(
    split: LayerSplit, model_stages: int, layout: str | None = None, mtp_num_layers: int = 0
) -> list[str]:
    """The split as one layout string per model stage, in pipeline order: ``layout`` as given
    (checked as Megatron-Core checks it, the MTP layers in the loss's stage where our
    schedules place them), else :func:`stage_layer_counts` with the embedding first and the
    MTP layers and the loss last; :class:`ScheduleError` with the fix where it does not split
    (where the layers do not split evenly, with :func:`even_layout` as a layout that does)."""
    if layout is None:
        try:
            counts = stage_layer_counts(split, model_stages)
        except UnevenSplit as err:
            even = even_layout(split.num_layers, model_stages, mtp_num_layers)
            if even is None:
                raise
            counts = split.first is not None or split.last is not None
            instead = " instead of them" if counts else ""
            raise UnevenSplit(
                f"{err}; or set pipeline_model_parallel_layout: {even}{instead} (the layers as "
                "even as they go, the embedding, the loss and each MTP layer counted as one)"
            ) from None
        return stages_from_counts(counts, mtp_num_layers)
    if (
        split.first is not None
        or split.last is not None
        or split.account_for_embedding
        or split.account_for_loss
    ):
        raise ScheduleError(
            "a layout string cannot be combined with first/last stage layer counts or with "
            "accounting for the embedding or loss (as in Megatron-Core): use one of them"
        )
    stages = parse_layout(layout)
    check_layout(stages, split.num_layers, mtp_num_layers, model_stages)
    if mtp_num_layers and MTP not in stages[-1]:
        raise ScheduleError(
            "the pipeline layout must end with the MTP layers (m) and the loss (L) in the "
            "last stage: the MTP block lives with the loss"
        )
    return stages


def stages_from_counts(counts: list[int], mtp_num_layers: int) -> list[str]:
    """Layout strings for decoder ``counts`` per stage: the embedding first, the MTP layers
    and the loss last."""
    last = len(counts) - 1
    return [
        (EMBEDDING if i == 0 else "")
        + DECODER * c
        + (MTP * mtp_num_layers + LOSS if i == last else "")
        for i, c in enumerate(counts)
    ]


def even_layout(num_layers: int, model_stages: int, mtp_num_layers: int = 0) -> str | None:
    """A layout string (:func:`~.layout.format_layout`) of ``model_stages`` stages holding
    ``num_layers`` decoder layers as evenly as they go, the embedding (first stage), the
    loss and each MTP layer (last stage) counted as one layer: every stage is filled to one
    level, and the layers beyond ``num_layers`` are taken back from the first stage, the
    last, then the middle ones from the back; None where a stage would hold nothing. A
    balance by count: ``simulate --config`` balances on time or FLOPs."""
    fixed = [1 + (i == model_stages - 1) * (1 + mtp_num_layers) for i in range(model_stages)]
    level = 0
    while sum(max(0, level - f) for f in fixed) < num_layers:
        level += 1
    counts = [max(0, level - f) for f in fixed]
    order = [0, model_stages - 1, *range(model_stages - 2, 0, -1)]
    excess = sum(counts) - num_layers
    for stage in order:
        if excess and counts[stage] and counts[stage] + fixed[stage] == level:
            counts[stage] -= 1
            excess -= 1
    stages = stages_from_counts(counts, mtp_num_layers)
    return format_layout(stages) if all(stages) else None


def _uneven(split: LayerSplit, model_stages: int) -> list[int]:
    fixed = {0: split.first, model_stages - 1: split.last}
    fixed = {stage: count for stage, count in fixed.items() if count is not None}
    if model_stages == 1 and len({split.first, split.last} - {None}) > 1:
        raise ScheduleError("a one-stage model cannot have different first and last counts")
    if any(count < 1 for count in fixed.values()):
        raise ScheduleError("first/last stage layer counts must be >= 1 (as in Megatron-Core)")
    rest = split.num_layers - sum(fixed.values())
    middle = model_stages - len(fixed)
    if rest < 0:
        counts = " + ".join(str(count) for count in fixed.values())
        raise ScheduleError(
            f"the first/last stage layer counts ({counts}) exceed num_layers "
            f"({split.num_layers}): lower them, or raise num_layers"
        )
    if (middle == 0 and rest) or (middle and rest % middle):
        raise UnevenSplit(
            f"after {sum(fixed.values())} layers in the first/last stage, {rest} layers do "
            f"not split evenly into the other {middle} stages: change the first/last counts"
        )
    share = rest // middle if middle else 0
    return [fixed.get(stage, share) for stage in range(model_stages)]
