"""``train`` on configs/tiny_deepseek_cpu.yaml (DeepSeek-V3's structure in small: uneven
stages, MLA, dense-then-MoE at EP=2 with expert bias, one MTP layer; PP=2 x DP=2): every
iteration prints Megatron-LM's log line with the MTP loss, and checkpoints are
layout-agnostic across splits and schedules.

A checkpoint saved at iteration 3 under dualpipev with first/last counts 1/2 resumes under
dualpipe with a layout string and under 1f1b with other first/last counts; one saved under
dualpipe resumes under dualpipev with a layout string (stage 0 holding the embedding
alone). Iterations 4-6 (model, expert bias, optimizer state, learning-rate schedule and
data position restored; the MTP block and the embedding copies reassembled) give the
uninterrupted run's LM and MTP losses within 1e-6 relative (clipped, another placement:
tests/digits.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import load_config, train
from tests.digits import beyond

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc, pytest.mark.slow]

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_deepseek_cpu.yaml"
ITERATIONS, SAVED_AT = 6, 3
#: How each run splits the 7 layers; the config's own is dualpipev with first/last 1/2.
SPLITS = {
    "dualpipev": [],
    "dualpipev-layout": [
        "decoder_first_pipeline_num_layers=null",
        "decoder_last_pipeline_num_layers=null",
        "pipeline_model_parallel_layout=E|ttt|ttt|tmL",
    ],
    "dualpipe-layout": [
        "pipeline_schedule=dualpipe",
        "decoder_first_pipeline_num_layers=null",
        "decoder_last_pipeline_num_layers=null",
        "pipeline_model_parallel_layout=Ettt|ttttmL",
    ],
    "dualpipe": [
        "pipeline_schedule=dualpipe",
        "decoder_first_pipeline_num_layers=4",
        "decoder_last_pipeline_num_layers=3",
    ],
    "1f1b": [
        "pipeline_schedule=1f1b",
        "decoder_first_pipeline_num_layers=2",
        "decoder_last_pipeline_num_layers=5",
    ],
}
LINE = re.compile(r" lm loss: (\S+) \| mtp_1 loss: (\S+) \| loss scale: 1\.0 \|")
ELAPSED = re.compile(r"elapsed time per iteration \(ms\): (\S+) \|")


def _run(split: str, *overrides: str):
    cfg = load_config(
        CONFIG,
        [
            f"train_iters={ITERATIONS}",
            "eval_interval=null",
            "output_dir=null",
            *SPLITS[split],
            *overrides,
        ],
    )
    return train(cfg, source=str(CONFIG))


@pytest.fixture(scope="module")
def uninterrupted():
    return _run("dualpipev")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    roots = {}
    for split in ("dualpipev", "dualpipe"):
        root = tmp_path_factory.mktemp(split)
        result = _run(split, f"exit_interval={SAVED_AT}", f"save={root}")
        assert result.saved == [SAVED_AT]
        roots[split] = root
    return roots


def test_every_iteration_prints_the_lm_and_mtp_loss(uninterrupted) -> None:
    printed = [m.groups() for m in map(LINE.search, uninterrupted.lines) if m]
    assert len(printed) == ITERATIONS
    losses, mtp = uninterrupted.losses, uninterrupted.mtp_losses
    assert [lm for lm, _ in printed] == [f"{losses[i]:.6E}" for i in sorted(losses)]
    assert [m for _, m in printed] == [f"{mtp[i][0]:.6E}" for i in sorted(mtp)]
    assert losses[ITERATIONS] < losses[1] and mtp[ITERATIONS][0] < mtp[1][0]


def test_the_first_iteration_takes_about_as_long_as_the_others(uninterrupted) -> None:
    """It took 11-19 s against 0.6 s, compiling the expert-bias router function with
    inductor on every rank; the ranks now run torch.compile'd functions eagerly on CPU."""
    first, *later = [float(m.group(1)) for m in map(ELAPSED.search, uninterrupted.lines) if m]
    assert len(later) == ITERATIONS - 1
    assert first < 3 * max(later) + 2000.0, (first, later)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved_under", "resumed_under"),
    [("dualpipev", "dualpipe-layout"), ("dualpipev", "1f1b"), ("dualpipe", "dualpipev-layout")],
)
def test_resume_under_another_split_and_schedule(
    uninterrupted, saved: dict[str, Path], saved_under: str, resumed_under: str
) -> None:
    result = _run(resumed_under, f"load={saved[saved_under]}")
    assert result.resumed_from == SAVED_AT
    assert sorted(result.losses) == list(range(SAVED_AT + 1, ITERATIONS + 1))
    different = beyond(result.losses, uninterrupted.losses)
    different.update(
        ((i, "mtp"), off)
        for i, off in beyond(
            {i: mtp[0] for i, mtp in result.mtp_losses.items()},
            {i: mtp[0] for i, mtp in uninterrupted.mtp_losses.items()},
        ).items()
    )
    assert not different, f"{saved_under} -> {resumed_under}: {different}"


@pytest.mark.slow
def test_fb_overlap_gives_the_same_losses() -> None:
    """bf16 with MLA, MTP and dense-then-MoE: FB pairs through Megatron's schedule plan
    (every FB action overlapped) print the losses of sequential FB pairs."""
    runs = {
        overlap: _run("dualpipev", "bf16=true", f"overlap_moe_expert_parallel_comm={overlap}")
        for overlap in (False, True)
    }
    assert runs[True].losses == runs[False].losses
    assert runs[True].mtp_losses == runs[False].mtp_losses
    assert any(
        line.startswith(" overlapped FB pairs per step: 6 (of 6") for line in runs[True].lines
    )
