"""The README's "Train on your own data" block runs as written.

The block's two ``megatron-dualpipe`` commands run through the CLI (``python -m
megatron_dualpipe``) in a scratch directory holding a copy of ``configs/``, the
``corpus.jsonl`` and the ``tokenizer/`` directory the README asks for (made here offline:
tests/corpus.py). Preprocessing must say what it wrote; training must run its 20
iterations on that data with falling losses, evaluate, write its TensorBoard events and end
with "training done".
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.corpus import train_tokenizer, write_corpus

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
LOSS = re.compile(r"^ \[[^]]+\] iteration +(\d+)/ +20 \|.* lm loss: (\S+) \|")


def _block() -> list[list[str]]:
    """The README block's commands, each as argv after ``megatron-dualpipe``."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("### Train on your own data", 1)[1]
    block = block.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()[:1] != "#"]
    assert all(argv[0] == "megatron-dualpipe" for argv in commands), commands
    return [argv[1:] for argv in commands]


def test_the_readme_data_block_runs_as_written(tmp_path: Path) -> None:
    commands = _block()
    assert [argv[0] for argv in commands] == ["preprocess", "train"]
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    write_corpus(tmp_path / "corpus.jsonl")
    train_tokenizer(tmp_path / "corpus.jsonl", tmp_path / "tokenizer")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    outputs = []
    for argv in commands:
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_dualpipe", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.splitlines())
    preprocessed, trained = outputs

    assert preprocessed[0].startswith(
        "wrote data/corpus_text_document.bin and data/corpus_text_document.idx: 120 documents, "
    )
    assert (tmp_path / "data" / "corpus_text_document.idx").is_file()
    losses = {int(m[1]): float(m[2]) for m in map(LOSS.match, trained) if m}
    assert sorted(losses) == list(range(1, 21))
    assert losses[20] < losses[1] - 1.0, losses
    assert sum(" validation loss at iteration " in line for line in trained) == 2
    board = tmp_path / "runs" / "tiny_gpt_data-tensorboard" / "tiny_gpt_data-dualpipev"
    events = list(board.glob("events.out.tfevents.*"))  # the run's own folder
    assert events, "no TensorBoard event file"
    assert trained[-1].startswith(" training done: iteration 20 after ")
    assert trained[-1].endswith(
        "; outputs: timeline runs/tiny_gpt_data-dualpipev/timeline.png, TensorBoard events in "
        "runs/tiny_gpt_data-tensorboard/tiny_gpt_data-dualpipev"
    )
