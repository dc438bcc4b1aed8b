"""``train``'s first steps as a cluster starts them: Megatron's ``initialize_model_parallel``
with our embedding ranks (which leaves the pipeline's ranks holding different numbers of
process groups), then the steps through our set-up on forked gloo ranks, over the code a
GPU run takes (the pipeline group itself, batched messages, the set-up probes, dualpipe's
mirror sum). dualpipe and dualpipev at PP 4, at PP 2 with TP 2 and with EP 2 (the MoE
model), and at PP 8: two iterations with clipping off, against 1F1B with the same settings
(dualpipev its digits; dualpipe, whose two copies each sum half the micro-batches'
gradients, within a millionth). Megatron-LM's ``pretrain()`` does the same at PP 4 in
``tests/test_megatron_lm_loop.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import load_config, train
from tests.multiproc import slow_unless

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ITERATIONS = 2
REL_TOL = 1e-6
#: name: (config, settings), each at world 4 but PP 8.
SHAPES = {
    "pp4": ("tiny_gpt_cpu.yaml", ["pipeline_model_parallel_size=4", "world_size=4"]),
    "pp2-tp2": ("tiny_gpt_cpu.yaml", ["tensor_model_parallel_size=2", "world_size=4"]),
    "pp2-ep2": ("tiny_moe_cpu.yaml", []),
    "pp8": (
        "tiny_gpt_cpu.yaml",
        [
            "pipeline_model_parallel_size=8",
            "world_size=8",
            "num_layers=16",
            "global_batch_size=32",
        ],
    ),
}


def _losses(shape: str, schedule: str) -> list[float]:
    config, settings = SHAPES[shape]
    cfg = load_config(
        CONFIGS / config,
        [
            *settings,
            f"pipeline_schedule={schedule}",
            f"train_iters={ITERATIONS}",
            "clip_grad=0",
            "lr_warmup_iters=0",
            "eval_interval=null",
            "output_dir=null",
        ],
    )
    result = train(cfg, source=config)
    return [result.losses[i] for i in sorted(result.losses)]


@pytest.mark.parametrize("shape", slow_unless(lambda s: s == "pp4", list(SHAPES)))
def test_first_steps_after_megatrons_set_up_as_1f1b(shape: str) -> None:
    reference = _losses(shape, "1f1b")
    assert len(reference) == ITERATIONS
    assert _losses(shape, "dualpipev") == reference
    dualpipe = _losses(shape, "dualpipe")
    assert dualpipe == pytest.approx(reference, rel=REL_TOL)
