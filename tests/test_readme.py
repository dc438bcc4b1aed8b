"""The README's commands leave the checkout clean: every file they write is git-ignored."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _written_by_readme() -> set[str]:
    """Paths the README's bash blocks write: output options' values, ``--set save=...``,
    ``preprocess --output-prefix``'s dataset,
    the per-schedule and before/after names of ``--png``, train's runs/, Slurm's logs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", readme, re.S))
    paths = {m.rstrip("]") for m in re.findall(r"--(?:png|json|trace|save|out)\s+(\S+)", blocks)}
    paths |= {f"{m}/iter_0000005" for m in re.findall(r"--set save=(\S+)", blocks)}
    paths |= {f"{m}_text_document.bin" for m in re.findall(r"--output-prefix\s+(\S+)", blocks)}
    for png in [p for p in paths if p.endswith(".png")]:
        paths |= {png.replace(".png", f"_{s}.png") for s in ("dualpipev", "before", "after")}
    paths |= {"runs/tiny_gpt_cpu/timeline.png", "slurm-dualpipe-cpu-42.out", "slurm-dualpipe-7.out"}
    return paths


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout"
)
def test_every_file_the_readme_writes_is_ignored() -> None:
    paths = sorted(_written_by_readme())
    assert {"ckpt/iter_0000005", "out.png", "out.json", "schedule.txt", "bench.json",
            "megatron-lm-patched", "data/corpus_text_document.bin"} <= set(paths)  # fmt: skip
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *paths],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert [line.split("\t")[-1] for line in lines if line.startswith("::")] == []
