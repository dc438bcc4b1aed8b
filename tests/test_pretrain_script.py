"""scripts/pretrain_gpt_dualpipe.py: Megatron-LM-style flags become the same config as YAML."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import ConfigError, TrainConfig, load_config
from megatron_dualpipe.megatron.training.config import config_keys
from megatron_dualpipe.megatron.training.config.megatron_lm_flags import (
    LATER_MEGATRON_LM_FLAGS,
    MEGATRON_LM_FLAGS,
)

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


def test_unknown_schedule_is_one_sentence_naming_the_flag() -> None:
    match = r"^--pipeline-schedule gpipe: pipeline_schedule: 'gpipe' is not one of"
    with pytest.raises(ConfigError, match=match):
        script.config_from_args(script.parse_args(["--pipeline-schedule", "gpipe", *TINY]))


def test_megatrons_overlap_flag_sets_the_key() -> None:
    path = ROOT / "configs" / "tiny_moe_cpu.yaml"
    argv = ["--yaml-cfg", str(path), "--bf16", "--overlap-moe-expert-parallel-comm"]
    cfg = script.config_from_args(script.parse_args(argv))
    assert cfg.overlap_moe_expert_parallel_comm is True and cfg.bf16 is True
    with pytest.raises(ConfigError, match="overlap_moe_expert_parallel_comm: needs a bf16"):
        script.config_from_args(script.parse_args(argv[:2] + argv[3:]))


def _config_actions():
    parser, _ = script.build_parser()
    return [a for a in parser._actions if a.dest not in ("help", "yaml_cfg")]


def test_every_config_key_has_a_flag_and_every_flag_sets_a_key() -> None:
    keys = {f.name for f in dataclasses.fields(TrainConfig)}
    actions = _config_actions()
    set_by_flags = {a.dest.removeprefix("config.") for a in actions}
    assert set_by_flags == keys
    assert all(a.dest.startswith("config.") for a in actions)


def test_flags_are_spelled_as_megatron_lm_spells_them() -> None:
    """Each Megatron-LM key's flags (not the added opposites) are Megatron-LM's spellings."""
    for key in config_keys():
        if key.megatron_lm:
            assert key.flags[0] in MEGATRON_LM_FLAGS | LATER_MEGATRON_LM_FLAGS.keys(), key.name
            # Megatron-LM's name of the setting, which its arguments.py spells otherwise.
            others = set(key.flags) - MEGATRON_LM_FLAGS - LATER_MEGATRON_LM_FLAGS.keys()
            assert others <= {"--virtual-pipeline-model-parallel-size"}, key.name
        else:
            assert not set(key.flags) & MEGATRON_LM_FLAGS, key.name
    options = {o for a in _config_actions() for o in a.option_strings}
    for flag in (
        "--max-position-embeddings", "--ffn-hidden-size", "--num-query-groups", "--swiglu",
        "--bf16", "--sequence-parallel", "--lr-decay-iters", "--exit-interval",
        "--virtual-pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
        "--disable-bias-linear", "--no-check-for-nan-in-loss-and-grad",
        "--override-opt_param-scheduler", "--untie-embeddings-and-output-weights",
    ):  # fmt: skip
        assert flag in options


def test_every_flag_has_help_from_its_keys_documentation() -> None:
    docs = {key.name: key.doc for key in config_keys()}
    for action in _config_actions():
        key = action.dest.removeprefix("config.")
        assert docs[key] and docs[key] in action.help, action.option_strings
    parser, _ = script.build_parser()
    text = parser.format_help()
    assert "default: 1f1b" in text and "[max_position_embeddings]" in text


def test_megatron_lm_flags_set_their_keys() -> None:
    path = ROOT / "configs" / "tiny_gpt_cpu.yaml"
    argv = [
        "--yaml-cfg", str(path), "--max-position-embeddings", "32", "--ffn-hidden-size", "96",
        "--num-query-groups", "2", "--swiglu", "--lr-decay-iters", "15", "--exit-interval", "5",
        "--disable-bias-linear", "--no-check-for-nan-in-loss-and-grad",
        "--tensorboard-log-interval", "4",
    ]  # fmt: skip
    cfg = script.config_from_args(script.parse_args(argv))
    assert cfg.tensorboard_log_interval == 4
    assert (cfg.max_position_embeddings, cfg.ffn_hidden_size, cfg.num_query_groups) == (32, 96, 2)
    assert (cfg.swiglu, cfg.lr_decay_iters, cfg.exit_interval) == (True, 15, 5)
    assert (cfg.add_bias_linear, cfg.check_for_nan_in_loss_and_grad) == (False, False)
    moe = ROOT / "configs" / "tiny_moe_cpu.yaml"
    assert load_config(moe).add_bias_linear is False
    undone = script.parse_args(["--yaml-cfg", str(moe), "--add-bias-linear"])
    with pytest.raises(ConfigError, match="^--add-bias-linear: add_bias_linear: MoE"):
        script.config_from_args(undone)


def test_interleaved_takes_the_virtual_pipeline_flag() -> None:
    path = ROOT / "configs" / "tiny_gpt_cpu.yaml"
    flags = ("--virtual-pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank")
    for flag in flags:
        argv = ["--yaml-cfg", str(path), "--pipeline-schedule", "interleaved-1f1b", flag, "2"]
        cfg = script.config_from_args(script.parse_args(argv))
        assert (cfg.pipeline_schedule, cfg.virtual_pipeline_model_parallel_size) == (
            "interleaved-1f1b",
            2,
        )
        assert cfg.model_chunks == 2


def test_a_bad_flag_value_is_blamed_on_the_flag() -> None:
    argv = [*TINY]
    argv[argv.index("--global-batch-size") + 1] = "5"
    with pytest.raises(ConfigError, match="^--global-batch-size 5: global_batch_size: 5 is not"):
        script.config_from_args(script.parse_args(argv))
    with pytest.raises(ConfigError, match="^--num-layers: num_layers: expected an integer"):
        script.config_from_args(script.parse_args([*TINY, "--num-layers", "x"]))


def test_an_unsupported_megatron_lm_flag_is_refused_in_one_sentence(
    capsys: pytest.CaptureFixture,
) -> None:
    with pytest.raises(SystemExit) as exit_:
        script.parse_args([*TINY, "--fp16"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "pretrain_gpt_dualpipe.py: error: --fp16 is a Megatron-LM flag this script does not "
        "support (megatron-dualpipe's training config has no such key): remove it; --help "
        "lists the flags it takes\n"
    )


def test_every_refused_flag_of_a_pasted_launch_line_is_named_at_once(
    capsys: pytest.CaptureFixture,
) -> None:
    """Megatron-LM's flags without a key, then a misspelling, in one sentence; values of
    the refused flags are not mistaken for flags."""
    pasted = ["--fp16", "--rampup-batch-size", "16", "16", "5859375", "--attention-backend",
              "flash", "--num-layerz", "3", "--fp16"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        script.parse_args([*TINY, *pasted])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "pretrain_gpt_dualpipe.py: error: --fp16, --rampup-batch-size, --attention-backend are "
        "Megatron-LM flags this script does not support (megatron-dualpipe's training config "
        "has no such keys), and unrecognized argument: --num-layerz (did you mean "
        "--num-layers?): remove them; --help lists the flags it takes\n"
    )


def test_flags_that_change_nothing_here_are_accepted_with_one_note(
    capsys: pytest.CaptureFixture,
) -> None:
    plain = script.config_from_args(script.parse_args(TINY))
    assert capsys.readouterr().err == ""
    noops = ["--use-mcore-models", "--use-flash-attn", "--use-mcore-models"]
    args = script.parse_args([*TINY, *noops])
    assert script.config_from_args(args) == plain
    assert capsys.readouterr().err == (
        "pretrain_gpt_dualpipe.py: note: --use-mcore-models, --use-flash-attn change nothing "
        "here, ignored (megatron-core's models are the only ones here, and Megatron-LM ignores "
        "the flag too; Megatron-LM's megatron-core models read it nowhere: Transformer "
        "Engine's attention (transformer_impl: transformer_engine) picks its fused or flash "
        "backend itself)\n"
    )


@pytest.mark.parametrize(
    ("word", "message"),
    [
        ("--num-layerz", "unrecognized argument: --num-layerz (did you mean --num-layers?)"),
        ("--max-pos", "unrecognized argument: --max-pos (did you mean --max-position-embeddings?)"),
        ("--lr-decay", "unrecognized argument: --lr-decay (did you mean --lr-decay-iters?)"),
        ("--qwerty", "unrecognized argument: --qwerty\n"),
    ],
)
def test_a_misspelt_flag_gets_a_close_match(
    capsys: pytest.CaptureFixture, word: str, message: str
) -> None:
    with pytest.raises(SystemExit):
        script.parse_args([*TINY, word, "3"])
    assert message in capsys.readouterr().err


def _readme_pretrain_commands() -> list[list[str]]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    text = next(b for b in blocks if "python scripts/pretrain_gpt_dualpipe.py" in b)
    lines = text.replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip()]


def test_readme_pretrain_example_parses_as_written() -> None:
    commands = _readme_pretrain_commands()
    assert len(commands) == 2 and "..." not in str(commands)
    for command in commands:
        assert command[:2] == ["python", "scripts/pretrain_gpt_dualpipe.py"]
        args = script.parse_args(command[2:])
        if args.yaml_cfg is not None:
            args.yaml_cfg = ROOT / args.yaml_cfg
        script.config_from_args(args)


@pytest.mark.slow
@pytest.mark.megatron
def test_readme_pretrain_example_runs_as_written(tmp_path: Path) -> None:
    """The README's commands, run from a folder laid out as the repository (the runs/ they
    write go there)."""
    for name in ("scripts", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for command in _readme_pretrain_commands():
        done = subprocess.run(
            [sys.executable, *command[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert " training done: iteration" in done.stdout
