#!/usr/bin/env bash
# Installs megatron-dualpipe (editable) with its test tools into the current Python
# environment, saying what it installs and letting pip show its progress; it asks nothing,
# so it runs the same in CI (CI=true, no stdin).
# Users bring their own (CUDA) torch; where none is installed we take torch 2.13.0, which on
# a CPU-only machine resolves to the CPU build instead of a multi-GB CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "install.sh: $*"; }
pip_install() { python -m pip install --no-input "$@"; }

say "into $(python -c 'import sys; print(sys.prefix)') (Python $(python -c 'import platform; print(platform.python_version())'))"
if python -c "import torch" 2>/dev/null; then
  say "keeping the installed torch $(python -c 'import torch; print(torch.__version__)')"
else
  say "installing torch==2.13.0 (no torch found; several hundred MB, a minute or more)"
  pip_install torch==2.13.0
fi
say "installing megatron-dualpipe (editable) and its test extra from setup.py:" \
  "megatron-core, psutil, pytest, pytest-timeout, ruff, dualpipe, with matplotlib, PyYAML, SciPy"
pip_install -e ".[test]"
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
say "done: $(python -m megatron_dualpipe --version)"
