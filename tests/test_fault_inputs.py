"""Bad ``--yaml-cfg`` files of the pretrain script are one sentence each, before any work
(bad launcher variables: tests/test_rank_env.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import ConfigError

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "pretrain_gpt_dualpipe", ROOT / "scripts" / "pretrain_gpt_dualpipe.py"
)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "{path}: cannot read the config: No such file or directory"),
        ("lr: [1\n", "{path}: not valid YAML: line 2, column 1: expected ',' or ']', but got "
         "'<stream end>'"),
        ("lr: abc\n", "{path}: lr: expected a number, got 'abc' (str)"),
        ("min_lrr: 1\n", "{path}: min_lrr: unknown key (did you mean 'min_lr'?)"),
    ],
)  # fmt: skip
def test_a_bad_yaml_cfg_is_named_as_the_file(tmp_path: Path, capsys, text, message) -> None:
    path = tmp_path / "missing.yaml" if text is None else _yaml(tmp_path, text)
    assert script.main(["--yaml-cfg", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"pretrain_gpt_dualpipe.py: error: {message.format(path=path)}\n"


def test_a_bad_flag_value_is_named_as_the_flag(capsys) -> None:
    yaml_cfg = str(ROOT / "configs" / "tiny_gpt_cpu.yaml")
    assert script.main(["--yaml-cfg", yaml_cfg, "--lr", "abc"]) == 2
    assert capsys.readouterr().err == (
        "pretrain_gpt_dualpipe.py: error: --lr: lr: expected a number, got 'abc'\n"
    )


def test_megatron_lm_spellings_of_the_new_keys() -> None:
    yaml_cfg = str(ROOT / "configs" / "tiny_gpt_cpu.yaml")
    cfg = script.config_from_args(
        script.parse_args(["--yaml-cfg", yaml_cfg, "--no-check-for-nan-in-loss-and-grad",
                           "--override-opt_param-scheduler", "--load", "/x", "--ckpt-step", "3"])
    )  # fmt: skip
    assert cfg.check_for_nan_in_loss_and_grad is False
    assert cfg.override_opt_param_scheduler is True and cfg.ckpt_step == 3
    with pytest.raises(ConfigError, match="are both set"):
        script.config_from_args(
            script.parse_args(["--yaml-cfg", yaml_cfg, "--override-opt_param-scheduler",
                               "--use-checkpoint-opt_param-scheduler"])
        )  # fmt: skip
