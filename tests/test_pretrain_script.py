"""scripts/pretrain_gpt_dualpipe.py: Megatron-LM-style flags become the same config as YAML."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "pretrain_gpt_dualpipe", ROOT / "scripts" / "pretrain_gpt_dualpipe.py"
)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

TINY = [
    "--pipeline-model-parallel-size", "2", "--num-layers", "8", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
    "--global-batch-size", "16", "--train-iters", "20", "--lr", "3e-3", "--vocab-size", "128",
]  # fmt: skip


def test_flags_alone_make_a_config() -> None:
    cfg = script.config_from_args(script.parse_args(["--pipeline-schedule", "dualpipev", *TINY]))
    assert (cfg.pipeline_schedule, cfg.pipeline_model_parallel_size) == ("dualpipev", 2)
    assert (cfg.num_layers, cfg.lr, cfg.global_batch_size) == (8, 3e-3, 16)


def test_flags_override_the_yaml_config() -> None:
    path = ROOT / "configs" / "tiny_gpt_cpu.yaml"
    args = script.parse_args(
        [
            "--yaml-cfg",
            str(path),
            "--pipeline-schedule",
            "1f1b",
            "--train-iters",
            "5",
            "--use-distributed-optimizer",
        ]
    )
    cfg = script.config_from_args(args)
    base = load_config(path)
    assert (cfg.pipeline_schedule, cfg.train_iters) == ("1f1b", 5)
    assert cfg.use_distributed_optimizer is True
    assert (cfg.hidden_size, cfg.lr) == (base.hidden_size, base.lr)


def test_bad_combination_is_one_sentence() -> None:
    argv = ["--pipeline-schedule", "dualpipe", *TINY]
    argv[argv.index("--pipeline-model-parallel-size") + 1] = "3"
    argv[argv.index("--num-layers") + 1] = "6"
    with pytest.raises(ConfigError, match="dualpipe needs an even number of pipeline ranks"):
        script.config_from_args(script.parse_args(argv))


def test_unknown_schedule_is_refused_by_the_parser(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        script.parse_args(["--pipeline-schedule", "gpipe"])
    assert "invalid choice: 'gpipe'" in capsys.readouterr().err


def test_megatrons_overlap_flag_sets_the_key() -> None:
    path = ROOT / "configs" / "tiny_moe_cpu.yaml"
    argv = ["--yaml-cfg", str(path), "--bf16", "--overlap-moe-expert-parallel-comm"]
    cfg = script.config_from_args(script.parse_args(argv))
    assert cfg.overlap_moe_expert_parallel_comm is True and cfg.bf16 is True
    with pytest.raises(ConfigError, match="overlap_moe_expert_parallel_comm: needs a bf16"):
        script.config_from_args(script.parse_args(argv[:2] + argv[3:]))
