"""Small things a first hour with the commands ran into: errors name the flag a value came
from, two outputs of ``simulate`` never share a file, ``train --help`` lists the config
keys."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.megatron.training.config import config_keys

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("flags", "blamed"),
    [
        (["--train-iters", "1"], "with --train-iters 1: lr_warmup_iters: must be below"),
        (
            ["--tensor-model-parallel-size", "2"],
            "with --tensor-model-parallel-size 2: world_size: 2 ranks do not split",
        ),
    ],
)
def test_an_error_names_the_flag_whose_value_caused_it(flags: list[str], blamed: str) -> None:
    script = ROOT / "scripts" / "pretrain_gpt_dualpipe.py"
    yaml = ROOT / "configs" / "tiny_gpt_cpu.yaml"
    proc = subprocess.run(
        [sys.executable, str(script), "--yaml-cfg", str(yaml), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"pretrain_gpt_dualpipe.py: error: {yaml} {blamed}" in proc.stderr, proc.stderr


def test_two_simulate_outputs_naming_one_file_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    assert main(["simulate", "--trace", str(out), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--trace and --json both name {out}: one would overwrite the other" in err
    assert not out.exists()


def test_train_help_lists_every_config_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "scripts/pretrain_gpt_dualpipe.py --help" in text
    for key in config_keys():
        assert key.name in text, key.name
