"""DeepSeek-V3's structure under our schedules, against the one-process unpipelined run.

The model (tests/megatron_harness.py ``Model``): 10 layers, the first 2 dense and the rest
MoE (4 experts, top-2, a shared expert, sigmoid routing with expert bias and top-k scaling)
at expert-parallel size 2 (DP 2), multi-latent attention, RMSNorm, SwiGLU, one MTP layer,
with and without tied embeddings; the layers split unevenly over the schedule's model
stages by Megatron's first/last counts or by a layout string (read over the model stages in
pipeline order; "E|tt|..." leaves stage 0 with the embedding alone). fp32 on CPU+gloo:
five Adam iterations (three for the positions and MTP cases) with Megatron's DDP give
every iteration's loss and MTP loss to 7 significant digits, and the first iteration's
gradient of every parameter (by global name) within 1e-5 relative, as Megatron's
no-pipelining schedule in one process does.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dualpipe.megatron.schedule.checks import DualPipeConfigError, pipeline_setup
from tests.megatron_harness import Layout, Model, _check, check_training

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.multiproc,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU+gloo tests"),
]

NUM_LAYERS = 10


def _deepseek(tied: bool) -> Model:
    return Model(
        moe=True,
        deepseek=True,
        dense_first=2,
        mtp=1,
        num_layers=NUM_LAYERS,
        rope=True,
        tied=tied,
    )


#: (schedule, PP, split, tied): every schedule at PP=2 with both kinds of split, tied and
#: untied, and dualpipev at PP=4 (the suite's time: a PP=4 case is 30-50 s on 2 cores).
CASES = [
    ("dualpipev", 2, {"first": 1, "last": 3}, False),
    ("dualpipev", 2, {"layout": "Et|ttt|ttt|tttmL"}, True),
    ("dualpipev", 4, {"first": 2, "last": 2}, True),
    ("dualpipe", 2, {"first": 4, "last": 6}, True),
    ("dualpipe", 2, {"layout": "Etttt|ttttttmL"}, False),
    ("zb1p", 2, {"first": 3, "last": 7}, True),
]


def _id(case: tuple) -> str:
    schedule, pp, split, tied = case
    kind = "layout" if "layout" in split else "first-last"
    return f"{schedule}-pp{pp}-{kind}-{'tied' if tied else 'untied'}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_five_adam_steps_match_the_unpipelined_run(case: tuple) -> None:
    schedule, pp, split, tied = case
    layout = Layout(pp=pp, ep=2, dp=2, microbatches=2 * pp, schedule=schedule, **split)
    worst = check_training(_deepseek(tied), layout)
    assert worst["grad"] <= 1e-5


@pytest.mark.slow
def test_one_step_matches_the_unpipelined_run() -> None:
    """The fast representative: dualpipev at PP=2, layout string, tied, every feature;
    losses, MTP losses and gradients of one step, and the weights after a clipped SGD step."""
    layout = Layout(
        pp=2, ep=2, dp=2, ddp=True, optimizer=True, schedule="dualpipev", layout="Et|ttt|ttt|tttmL"
    )
    worst = _check(_deepseek(tied=True), layout, "dualpipev")
    assert set(worst) >= {"loss", "grad", "mtp_loss", "grad_norm", "stepped"}


@pytest.mark.parametrize(
    ("schedule", "pp", "split", "counts"),
    [
        ("dualpipev", 2, {"first": 1, "last": 3}, (1, 3, 3, 3)),
        ("dualpipev", 4, {"layout": "E|tt|t|tt|t|tt|t|tmL"}, (0, 2, 1, 2, 1, 2, 1, 1)),
        ("dualpipe", 4, {"first": 1, "last": 3}, (1, 3, 3, 3)),
        ("dualpipe", 2, {"layout": "Etttt|ttttttmL"}, (4, 6)),
        ("dualpipev", 2, {"account_for_embedding": True, "account_for_loss": True}, (2, 3, 3, 2)),
    ],
)
def test_splits_read_over_the_model_stages_in_pipeline_order(
    schedule: str, pp: int, split: dict, counts: tuple
) -> None:
    setup = pipeline_setup(schedule, pp, NUM_LAYERS, mtp_num_layers=1, **split)
    assert setup.stage_layers == counts


@pytest.mark.parametrize(
    ("schedule", "split", "message"),
    [
        (
            "dualpipev",
            {"layout": "Ettttt|ttttmL"},
            "runs 4 model stages: the pipeline layout has 2 stages but the schedule cuts",
        ),
        (
            "dualpipev",
            {"layout": "Et|ttt|ttttttm|L"},
            "end with the MTP layers \\(m\\) and the loss",
        ),
        (
            "dualpipev",
            {"layout": "t|Ettt|ttt|tttmL"},
            "must start with E \\(the embedding\\), once",
        ),
        (
            "dualpipe",
            {"layout": "Etttt|tttttmL"},
            "holds 9 decoder layers \\(t\\) but num_layers is 10",
        ),
        ("dualpipev", {"layout": "Et|ttt|ttt|tttmL", "first": 1}, "cannot be combined"),
        ("dualpipev", {"first": 3, "last": 2}, "5 layers do not split evenly into the other 2"),
        ("dualpipe", {"first": 2, "account_for_loss": True}, "cannot be combined"),
    ],
)
def test_a_split_that_cannot_run_is_one_sentence(schedule: str, split: dict, message: str) -> None:
    with pytest.raises(DualPipeConfigError, match=message) as info:
        pipeline_setup(schedule, 2, NUM_LAYERS, mtp_num_layers=1, **split)
    assert "\n" not in str(info.value)


#: Every schedule at PP=2 (interleaved-1f1b with two chunks per rank).
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev")
#: The fast case: Megatron's placement, whose MTP stage holds a copy of the learned
#: position table on another rank than the embedding (it trained apart from the original).
FAST_POSITIONS = ("zb1p", "learned", 1)


def _position_cases() -> list:
    cases = [(s, p, m) for s in SCHEDULES for p in ("learned", "rope") for m in (1, None)]
    return [
        pytest.param(
            case,
            marks=() if case == FAST_POSITIONS else pytest.mark.slow,
            id=f"{case[0]}-{case[1]}-{'mtp' if case[2] else 'no-mtp'}",
        )
        for case in cases
    ]


@pytest.mark.parametrize("case", _position_cases())
def test_positions_and_mtp_match_the_unpipelined_run(case: tuple) -> None:
    """Learned absolute and rotary positions, with and without an MTP layer, under every
    schedule: three Adam steps equal to the one-process run's (losses, MTP losses, the
    first step's gradients, the MTP block's copy of the position table included)."""
    schedule, positions, mtp = case
    model = Model(mtp=mtp, rope=positions == "rope", num_layers=8)
    vp = 2 if schedule == "interleaved-1f1b" else None
    ours = None if schedule in ("1f1b", "interleaved-1f1b") else schedule  # None: Megatron's
    worst = check_training(model, Layout(pp=2, vp=vp, schedule=ours), steps=3)
    assert worst["grad"] <= 1e-5
