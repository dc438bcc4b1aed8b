"""Our per-rank memory beside Megatron-LM's own ``theoretical_memory_usage`` formula, for the
same config under 1F1B: Megatron-LM's figure plus the named steps of
``planner/memory_bridge.py`` equals ours within ``TOLERANCE`` (relative), for the
weights with their gradients and optimizer states and for the activations.

The formula runs from a megatron-core wheel that ships ``megatron/training`` (0.19, on
Python 3.12): ``MEGATRON_TRAINING_PYTHON`` names its interpreter, else this one where it
has the formula (CI's Python 3.12 leg, which runs these tests: they are marked megatron),
else the venv ``.ci/py312.sh`` makes (``.ci/venv312``); without one these tests skip, saying so.
The CPU-only code never imports it. A pure-Python test (the fast one) checks the
activation bridge against the paper's formula by hand; the runs of Megatron-LM's formula
are slow (a megatron import each, about 40 s on two busy cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe.planner.advisor import ParallelSetup
from megatron_dualpipe.planner.memory import MemorySettings
from megatron_dualpipe.planner.memory_bridge import TOLERANCE, bridges
from megatron_dualpipe.planner.model_cost import ModelShape
from megatron_dualpipe.schedules.ir import ScheduleError
from megatron_dualpipe.schedules.registry import generate

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "megatron_memory_formula.py"


def _formula_python() -> str | None:
    """An interpreter whose megatron-core has ``megatron.training``'s memory formula."""
    given = os.environ.get("MEGATRON_TRAINING_PYTHON")
    candidates = [given] if given else []
    candidates += [sys.executable, str(ROOT / ".ci/venv312/bin/python")]
    for candidate in candidates:
        if not Path(candidate).exists():
            continue
        probe = subprocess.run(
            [candidate, "-c", "import megatron.training.theoretical_memory_usage"],
            capture_output=True,
            timeout=180,
        )
        if probe.returncode == 0:
            return candidate
    return None


@pytest.fixture(scope="module")
def formula_python() -> str:
    found = _formula_python()
    if found is None:
        pytest.skip(
            "no Python with megatron.training (Megatron-LM's theoretical_memory_usage): set "
            "MEGATRON_TRAINING_PYTHON to one (the megatron-core 0.19 wheel ships it)"
        )
    return found


CASES = {
    "deepseek-v3": ["configs/deepseek_v3_pp16.yaml"],
    "deepseek-v3-bf16-no-recompute": [
        "configs/deepseek_v3_pp16.yaml",
        "--set",
        "fp8=null",
        "--set",
        "recompute_granularity=null",
        "--set",
        "recompute_method=null",
        "--set",
        "recompute_num_layers=null",
    ],
    "dense-70b-gqa-tp8": ["configs/dense_70b_dualpipe.yaml", "--set", "sequence_parallel=false"],
    "tiny-gpt-layernorm-biases-mtp-tp2": [
        "configs/tiny_gpt_cpu.yaml",
        *("--set", "bf16=true", "--set", "mtp_num_layers=1"),
        *("--set", "tensor_model_parallel_size=2", "--set", "world_size=4"),
    ],
    "tiny-moe": ["configs/tiny_moe_cpu.yaml", "--set", "bf16=true"],
}


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_lms_formula_plus_the_named_steps_is_ours(
    formula_python: str, case: str, tmp_path: Path
) -> None:
    out = tmp_path / "bridges.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [formula_python, str(SCRIPT), *CASES[case], "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(out.read_text())
    assert [b["what"] for b in found] == ["weights, gradients and optimizer states", "activations"]
    for bridge in found:
        assert bridge["megatron"] > 0 and bridge["ours"] > 0
        assert abs(bridge["residual"]) <= TOLERANCE, bridge


def _dense_gpt() -> tuple[ModelShape, ParallelSetup]:
    shape = ModelShape(
        num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256
    )
    setup = ParallelSetup(
        micro_batch_size=2,
        global_batch_size=32,
        pipeline_schedule="1f1b",
        pipeline_model_parallel_size=4,
        tensor_model_parallel_size=2,
        world_size=8,
        bf16=True,
    )
    return shape, setup


def test_the_activation_bridge_reaches_the_papers_formula_by_hand() -> None:
    """Korthikanti et al. (2023), Table 2 without sequence parallelism, flash attention (no
    score terms): sbh(10 + 24/t) per layer, L layers on the first stage of 1F1B (P in
    flight of L/P each), plus the embedding's 8sbP + sbhP, times Megatron-LM's 1.05; our
    dense layer holds the same less the two dropout masks plus the softmax statistics."""
    shape, setup = _dense_gpt()
    s, b, h, t, p, n = 32, 2, 64, 2, 4, 8
    megatron = (s * b * h * (10 + 24 / t) * n + 8 * s * b * p + s * b * h * p) * 1.05
    schedule = generate("1f1b", p, 8)
    stages = ["Ett", "tt", "tt", "ttL"]
    _, activations = bridges(
        shape,
        setup,
        schedule,
        stages,
        MemorySettings(),
        megatron_weights=1.0,
        megatron_activations=megatron,
    )
    assert abs(activations.residual) <= 1e-12
    steps = {step.label.split(" ")[1]: step.bytes for step in activations.steps}
    assert steps["formula's"] == pytest.approx(-megatron * 0.05 / 1.05)


def test_the_bridge_is_for_1f1b_and_bf16_adam() -> None:
    shape, setup = _dense_gpt()
    with pytest.raises(ScheduleError, match="for 1F1B"):
        bridges(
            shape,
            setup,
            generate("dualpipe", 4, 8),
            ["Ett", "tt", "tt", "ttL"],
            MemorySettings(),
            megatron_weights=1.0,
            megatron_activations=1.0,
        )
