"""Files ``simulate`` and ``python -m bench`` read or write: what cannot be read is one
sentence, and what cannot be written is refused before any work (``simulate --png
/proc/x.png`` failed after simulating, ``bench --json /proc/x.json`` after 26 s of work,
losing the results). Before, random bytes given to ``--load`` or ``--config`` were a
``UnicodeDecodeError`` traceback, and ``bench --out FILE`` said only ``[Errno 17] File
exists``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench.__main__ import main as bench_main
from megatron_dualpipe.cli import main


def _error(capsys, *args: str, main=main, prog: str = "megatron-dualpipe") -> str:
    started = time.monotonic()
    assert main(list(args)) == 2
    assert time.monotonic() - started < 10.0  # before any work (with room for a loaded machine)
    captured = capsys.readouterr()
    assert captured.err.startswith(f"{prog}: error: ") and captured.err.count("\n") == 1
    return captured.err[len(f"{prog}: error: ") : -1]


def _bench_error(capsys, *args: str) -> str:
    return _error(capsys, *args, main=bench_main, prog="python -m bench")


@pytest.mark.parametrize("suffix", [".txt", ".json"])
def test_random_bytes_to_load_are_one_sentence(tmp_path: Path, capsys, suffix: str) -> None:
    path = tmp_path / f"random{suffix}"
    path.write_bytes(b"\xa5" + os.urandom(3000))
    assert _error(capsys, "simulate", "--load", str(path)) == (
        f"--load: {path} is not a schedule (not UTF-8 text): write one with simulate --save"
    )


def test_json_that_is_no_schedule_is_one_sentence(tmp_path: Path, capsys) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"a": 1}')
    assert _error(capsys, "simulate", "--load", str(path)) == (
        f"--load: {path} holds JSON but not a schedule (KeyError: 'name'): write one with "
        "simulate --json"
    )


def test_random_bytes_as_config_are_one_sentence(tmp_path: Path, capsys) -> None:
    path = tmp_path / "random.yaml"
    path.write_bytes(b"\xa5" + os.urandom(3000))
    assert _error(capsys, "simulate", "--config", str(path)) == (
        f"{path}: not valid YAML: not UTF-8 text"
    )


@pytest.mark.parametrize("flag", ["--png", "--trace", "--json", "--save"])
def test_an_output_that_cannot_be_written_is_refused_before_work(capsys, flag: str) -> None:
    assert _error(capsys, "simulate", flag, "/proc/megatron-dualpipe-x") == (
        f"{flag}: cannot write /proc/megatron-dualpipe-x (No such file or directory): name a "
        "file in a folder you can write to"
    )


def test_an_output_that_is_a_folder_is_refused(tmp_path: Path, capsys) -> None:
    assert _error(capsys, "simulate", "--json", str(tmp_path)) == (
        f"--json: {tmp_path} is a folder: name a file in it"
    )


def test_bench_outputs_are_checked_before_work(tmp_path: Path, capsys) -> None:
    assert _bench_error(capsys, "--json", "/proc/megatron-dualpipe-x.json") == (
        "--json: cannot write /proc/megatron-dualpipe-x.json (No such file or directory): "
        "name a file in a folder you can write to"
    )
    file = tmp_path / "afile"
    file.write_text("")
    assert _bench_error(capsys, "--out", str(file)) == (
        f"--out: {file} is a file: name a folder for BENCHMARKS.md and the figures"
    )
