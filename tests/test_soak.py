"""Soak: iterations of the tiny GPT under dualpipev on CPU hold steady.

Every 50 iterations (25 in short runs) each rank samples its resident memory, the torch
tensors alive in it, its pipeline executor's live activations and queued deferred dW
entries (between steps both must be exactly 0) and the most activations the step held at
once (the same every step, within DualPipeV's bound of 2 PP + 1 = 5). After a warm-up of
a fifth of the iterations, resident memory and live tensors must stay within 5% of their
first post-warm-up sample. The suite runs 125 iterations (warm-up 25, samples every 25,
under a minute on 2 idle cores); ``SOAK_ITERATIONS=1000`` runs the soak whose figures
docs/reliability.md gives (warm-up 200, about twelve minutes on a busy 2-core machine).
The figures are printed (``-s``).
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import psutil
import pytest
import torch

from megatron_dualpipe.megatron.training import load_config, loop, train
from megatron_dualpipe.runtime.executor import PipelineExecutor

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"
ITERATIONS = int(os.environ.get("SOAK_ITERATIONS", "125"))
EVERY, WARM_UP, TOLERANCE = max(25, ITERATIONS // 20), ITERATIONS // 5, 0.05
#: DualPipeV's activation bound per rank at PP=2 (2 PP + 1 stage-micro-batches).
BOUND = 5


def _is(obj: object, kind: type) -> bool:
    """``isinstance``, False for a weak proxy whose object is gone (gc lists those too, and
    asking one its class raises ReferenceError)."""
    try:
        return isinstance(obj, kind)
    except ReferenceError:
        return False


def _sample(iteration: int) -> dict[str, int]:
    objects = gc.get_objects()
    executors = [o for o in objects if _is(o, PipelineExecutor)]
    return {
        "iteration": iteration,
        "rss": psutil.Process().memory_info().rss,
        "tensors": sum(1 for o in objects if _is(o, torch.Tensor)),
        "live_activations": sum(e.live_activations for e in executors),
        "peak_activations": sum(e.peak_activations for e in executors),
        "deferred_dw": sum(len(e.store) for e in executors),
        "executors": len(executors),
    }


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_many_iterations_hold_memory_and_activations_steady(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = loop._Run.train_step

    def sampled_step(self, measure: bool):
        out = real_step(self, measure)
        if self.state.iteration % EVERY == 0:
            with (tmp_path / f"rank{os.environ['RANK']}.jsonl").open("a") as f:
                f.write(json.dumps(_sample(self.state.iteration)) + "\n")
        return out

    monkeypatch.setattr(loop._Run, "train_step", sampled_step)
    cfg = load_config(
        TINY,
        [f"train_iters={ITERATIONS}", "eval_interval=null", "log_interval=100",
         "output_dir=null", "lr_decay_style=constant"],
    )  # fmt: skip
    result = train(cfg, source=str(TINY))
    assert sorted(result.losses) == list(range(1, ITERATIONS + 1))
    for rank in (0, 1):
        samples = [json.loads(line) for line in (tmp_path / f"rank{rank}.jsonl").open()]
        assert [s["iteration"] for s in samples] == list(range(EVERY, ITERATIONS + 1, EVERY))
        print(f"\nrank {rank}: iteration, RSS MB, live tensors, live activations, deferred dW, "
              "peak activations in the step")  # fmt: skip
        for s in samples:
            counts = (s["live_activations"], s["deferred_dw"], s["peak_activations"])
            print(f"  {s['iteration']:5d} {s['rss'] / 2**20:8.1f} {s['tensors']:7d} "
                  + " ".join(f"{c:3d}" for c in counts))  # fmt: skip
        assert all(s["executors"] == 1 for s in samples)
        assert all(s["live_activations"] == 0 and s["deferred_dw"] == 0 for s in samples)
        peaks = {s["peak_activations"] for s in samples}
        assert len(peaks) == 1 and 0 < peaks.pop() <= BOUND, peaks
        steady = [s for s in samples if s["iteration"] > WARM_UP]
        for key in ("rss", "tensors"):
            base = steady[0][key]
            drift = max(abs(s[key] - base) / base for s in steady)
            print(f"  {key}: largest drift after warm-up {drift:.2%}")
            assert drift <= TOLERANCE, (rank, key, [s[key] for s in steady])
