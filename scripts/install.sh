#!/usr/bin/env bash
# Installs megatron-dualpipe with its test tools into the current Python environment.
# Users bring their own (CUDA) torch; where none is installed we take torch 2.13.0, which on
# a CPU-only machine resolves to the CPU build instead of a multi-GB CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install --quiet torch==2.13.0
fi
python -m pip install --quiet -e ".[test]"
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
