"""What a new user meets first: ``--version``, help without markup and with the defaults,
errors before any heavy import (a missing config and ``--help`` import neither torch nor
megatron), and simulate's micro-batch error in simulate's own terms."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe import __version__
from megatron_dualpipe.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"megatron-dualpipe {__version__}\n"


def test_top_level_help_is_plain_text(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":class:" not in text and ":mod:" not in text
    for command in ("simulate", "train", "--version"):
        assert command in text
    assert "bench" not in text  # the benchmark is the checkout's python -m bench


def test_simulate_help_shows_the_defaults(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--schedule {1f1b," in text and "(default: dualpipev;" in text
    assert "(default: F=1,B=1,W=1)" in text
    assert "time of one P2P hop (default: 0)" in text


def test_simulates_micro_batch_error_names_its_own_options(capsys: pytest.CaptureFixture) -> None:
    assert main(["simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "3"]) == 2
    err = capsys.readouterr().err
    assert "change --microbatches or --pp" in err and "global" not in err
    tiny = str(ROOT / "configs" / "tiny_gpt_cpu.yaml")
    assert main(["simulate", "--config", tiny, "--microbatches", "3"]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("got 3: change --microbatches")


_CLI = "megatron_dualpipe.cli"


@pytest.mark.parametrize(
    ("front", "argv", "expected"),
    [
        (_CLI, ["train", "--config", "missing.yaml"], "missing.yaml: cannot read the config"),
        (_CLI, ["--help"], "usage: megatron-dualpipe"),
        (_CLI, ["train", "--help"], "usage: megatron-dualpipe train"),
        (_CLI, ["simulate", "--help"], "usage: megatron-dualpipe simulate"),
        ("bench.__main__", ["--help"], "usage: python -m bench"),
    ],
)
def test_help_and_a_missing_config_import_no_torch(
    front: str, argv: list[str], expected: str
) -> None:
    """torch and megatron load only when a command needs them (a second or more of
    imports): help and a config error come before (the checkout's ``python -m bench`` too)."""
    code = (
        "import sys\n"
        f"from {front} import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron'}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert expected in done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_what_the_interpreter_prints_at_shutdown_follows_no_command() -> None:
    """The command's last line stays the last on stderr too: what the interpreter's
    shutdown writes there afterwards (torch 2.15's Triton bindings: some 30 lines of
    "nanobind: leaked ..."; here an exit handler stands for them) is dropped."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: sys.stderr.write('shutdown chatter\\n'))\n"
        "from megatron_dualpipe.cli import main\n"
        "sys.argv = ['megatron-dualpipe', 'simulate', '--schedule', 'dualpipev', '--pp', '2',"
        " '--microbatches', '3']\n"
        "sys.exit(main())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith("megatron-dualpipe: error: dualpipev needs")
    assert "shutdown chatter" not in proc.stderr
