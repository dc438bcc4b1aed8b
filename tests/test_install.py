"""Installing: ``scripts/install.sh`` says what it installs and asks nothing, and the base
package (no extras, so no torch) runs ``megatron-dualpipe simulate`` from a fresh venv."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for python: no torch; pip only logs its arguments; the rest is the real one.
echo "$*" >> "$LOG"
if [[ $1 == -c && $2 == *"import torch"* ]]; then exit 1; fi
if [[ $1 == -m && $2 == pip ]]; then echo "pip would run: $*"; exit 0; fi
exec "$REAL_PYTHON" "$@"
"""


def _setup_keywords() -> dict:
    """setup.py's ``install_requires`` and ``extras_require``."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.keywords)
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in (
        "install_requires", "extras_require")}  # fmt: skip


def _requirements(extra: str) -> list[str]:
    """The project names in setup.py's ``install_requires`` and in the extra ``extra``."""
    kw = _setup_keywords()
    specs = kw["install_requires"] + kw["extras_require"][extra]
    return [re.split(r"[<>=\[]", s)[0] for s in specs]


def test_install_sh_says_what_it_installs_and_asks_nothing(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text(FAKE_PYTHON, encoding="utf-8")
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "LOG": str(log),
        "REAL_PYTHON": sys.executable,
        "CI": "true",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install.sh")],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("install.sh: ")]
    assert any("installing torch==2.13.0" in line for line in said)
    text = " ".join(said).lower()
    for name in _requirements("test"):
        assert name.lower() in text, f"install.sh does not name {name}"
    assert said[-1].startswith("install.sh: done: megatron-dualpipe ")
    pips = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    assert pips == [
        "-m pip install --no-input torch==2.13.0",
        "-m pip install --no-input -e .[test]",
    ]  # no --quiet: pip's progress shows


@pytest.mark.slow
def test_the_base_package_simulates_without_torch(tmp_path: Path) -> None:
    """A wheel of the package, installed without dependencies into a venv that does not
    see this environment's packages; PyYAML (a base dependency) is linked in, as
    ``pip install megatron-dualpipe`` would install it. No network."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    src = tmp_path / "src"
    for name in files:
        if (ROOT / name).is_file() and not name.startswith(("tests/", "docs/")):
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--no-input", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, timeout=300)  # fmt: skip
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    wheel = next((tmp_path / "dist").glob("megatron_dualpipe-*.whl"))
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300)  # fmt: skip
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    ours = Path(sysconfig.get_paths()["purelib"])
    for name in ("yaml", "_yaml"):
        if (ours / name).exists():
            (site / name).symlink_to(ours / name)

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(venv / "bin" / "megatron-dualpipe"), *argv],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip

    probe = subprocess.run([str(python), "-c", "import torch"], capture_output=True)
    assert probe.returncode != 0, "the venv sees torch"
    one = run("simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "10")
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith("dualpipev: PP=4 micro-batches=10 stages=8 makespan=")
    every = run("simulate", "--schedule", "all", "--pp", "4", "--microbatches", "8")
    assert every.returncode == 0 and "dualpipe " in every.stdout, every.stderr
    assert run("--version").stdout.startswith("megatron-dualpipe ")
    config = str(src / "configs" / "tiny_gpt_cpu.yaml")
    train = run("train", "--config", config)
    assert train.returncode == 2 and "Traceback" not in train.stderr
    assert "train needs torch and megatron-core" in train.stderr
    assert "(it is not on PyPI), pip install -e '.[megatron]'" in train.stderr


def test_the_extras_take_ranges_so_a_containers_releases_stay() -> None:
    """An NGC container's transformers, tokenizers and tensorboard satisfy the extras (pip
    keeps them): lower bounds, no exact pins."""
    extras = _setup_keywords()["extras_require"]
    specs = {
        spec for name in ("data", "tensorboard", "test") for spec in extras[name]
        if spec.startswith(("transformers", "tokenizers", "tensorboard"))
    }  # fmt: skip
    assert specs == {"transformers>=4.40", "tokenizers>=0.19", "tensorboard>=2.14"}
