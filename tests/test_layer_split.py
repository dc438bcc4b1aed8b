"""Per-stage layer counts from Megatron's split settings equal Megatron-Core's own answer
(``get_num_layers_to_build`` per pipeline rank) wherever Megatron accepts the settings, and
what does not split is one sentence."""

from __future__ import annotations

import pytest
import torch

from megatron_dualpipe.schedules.ir import ScheduleError
from megatron_dualpipe.schedules.layer_split import (
    LayerSplit,
    even_layout,
    stage_layer_counts,
    stage_layouts,
)
from megatron_dualpipe.schedules.layout import check_layout, parse_layout

CASES = [
    (LayerSplit(8), 4),
    (LayerSplit(8), 2),
    (LayerSplit(61, first=3, last=4), 8),
    (LayerSplit(61, first=1, last=6), 8),
    (LayerSplit(10, first=2), 5),
    (LayerSplit(10, last=2), 5),
    (LayerSplit(10, first=2, last=2), 3),
    (LayerSplit(7, account_for_embedding=True), 4),
    (LayerSplit(7, account_for_loss=True), 4),
    (LayerSplit(6, account_for_embedding=True, account_for_loss=True), 4),
]


@pytest.mark.megatron
@pytest.mark.parametrize(("split", "stages"), CASES)
def test_counts_equal_megatrons(split: LayerSplit, stages: int) -> None:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=split.num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=stages,
        num_layers_in_first_pipeline_stage=split.first,
        num_layers_in_last_pipeline_stage=split.last,
        account_for_embedding_in_pipeline_split=split.account_for_embedding,
        account_for_loss_in_pipeline_split=split.account_for_loss,
        pipeline_dtype=torch.float32,
    )
    megatrons = [get_num_layers_to_build(config, pp_rank=r) for r in range(stages)]
    assert stage_layer_counts(split, stages) == megatrons
    assert sum(megatrons) == split.num_layers


@pytest.mark.parametrize(
    ("split", "stages", "message"),
    [
        (LayerSplit(10), 4, "10 layers do not split evenly into 4 stages"),
        (LayerSplit(61, first=3, last=3), 8, "55 layers do not split evenly into the other 6"),
        (LayerSplit(8, first=2, account_for_loss=True), 4, "cannot be combined"),
        (LayerSplit(4, first=6), 2, r"counts \(6\) exceed num_layers \(4\)"),
        (LayerSplit(4, last=0), 2, "must be >= 1"),
    ],
)
def test_what_does_not_split_is_one_sentence(split: LayerSplit, stages: int, message: str):
    with pytest.raises(ScheduleError, match=message):
        stage_layer_counts(split, stages)


@pytest.mark.parametrize(
    ("layers", "stages", "mtp", "layout"),
    [
        (61, 32, 1, "Et|(tt|)*30,mL"),  # DeepSeek-V3 under dualpipev at PP=16
        (61, 16, 1, "Et*3|(t*4|)*14,ttmL"),  # taken back from the first and last stage
        (10, 4, 0, "Ett|t*3|t*3|ttL"),
        (8, 4, 2, "Ett|t*3|t*3|mmL"),
    ],
)
def test_the_even_layout_holds_every_layer_and_splits_them_as_evenly_as_they_go(
    layers: int, stages: int, mtp: int, layout: str
) -> None:
    """Every stage's load (its layers, the embedding, the loss and each MTP layer as one)
    within one of the others, and the layout one Megatron-Core's rules take."""
    assert even_layout(layers, stages, mtp) == layout
    parsed = parse_layout(layout)
    assert check_layout(parsed, layers, mtp, stages) == [s.count("t") for s in parsed]
    loads = [len(stage) for stage in parsed]
    assert max(loads) - min(loads) <= 1


def test_a_split_that_does_not_go_evenly_names_the_even_layout() -> None:
    """What DeepSeek-V3's config says under dualpipev: the layout to paste, in the sentence;
    none where a stage would hold nothing."""
    with pytest.raises(ScheduleError) as refused:
        stage_layouts(LayerSplit(61, first=4, last=1), 32, mtp_num_layers=1)
    assert str(refused.value) == (
        "after 5 layers in the first/last stage, 56 layers do not split evenly into the other "
        "30 stages: change the first/last counts; or set pipeline_model_parallel_layout: "
        "Et|(tt|)*30,mL instead of them (the layers as even as they go, the embedding, the "
        "loss and each MTP layer counted as one)"
    )
    assert even_layout(3, 8) is None
    with pytest.raises(ScheduleError) as refused:
        stage_layouts(LayerSplit(3), 8)
    assert str(refused.value) == (
        "3 layers do not split evenly into 8 stages: use a multiple of 8, or set the first/last "
        "stage layer counts"
    )
