#!/usr/bin/env bash
# Installs megatron-dualpipe (editable) with its test tools into the current Python
# environment, saying what it installs and letting pip show its progress; it asks nothing,
# so it runs the same in CI (CI=true, no stdin).
# Users bring their own (CUDA) torch; where none is installed we take torch==2.13.0 from PyPI,
# whose Linux wheel is the CUDA build (several GB with its nvidia-* wheels; it runs on CPU
# too). On a machine without a GPU, install the CPU build first to save the download:
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "install.sh: $*"; }
pip_install() { python -m pip install --no-input "$@"; }

say "into $(python -c 'import sys; print(sys.prefix)') (Python $(python -c 'import platform; print(platform.python_version())'))"
if ! python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  say "note: train runs Megatron-LM's loop from megatron-core 0.19, published for Python 3.12" \
    "only; on this Python, simulate, python -m bench, preprocess and the tests run, and" \
    "train says so"
fi
if python -c "import torch" 2>/dev/null; then
  say "keeping the installed torch $(python -c 'import torch; print(torch.__version__)')"
else
  say "installing torch==2.13.0 from PyPI (no torch found): the CUDA build, several GB;" \
    "for the CPU build, stop and run: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
  pip_install torch==2.13.0
fi
say "installing megatron-dualpipe (editable) and its test extra from setup.py:" \
  "megatron-core, psutil, transformers, tokenizers, tensorboard, pytest, pytest-timeout, ruff," \
  "dualpipe, with matplotlib, PyYAML, SciPy"
pip_install -e ".[test]"
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
say "done: $(python -m megatron_dualpipe --version)"
