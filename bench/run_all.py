"""Regenerate docs/BENCHMARKS.md, its figures and docs/benchmarks.json (the simulated grid,
Megatron's, torch's and our schedules measured side by side, and torch's runtime alone).
Takes a few minutes. Extra arguments go to ``python -m bench``, e.g. ``--quick``.

    python bench/run_all.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    docs = ROOT / "docs"
    sys.exit(main(["--out", str(docs), "--json", str(docs / "benchmarks.json"), *sys.argv[1:]]))
