"""How ``megatron-dualpipe simulate`` scales: wall time, CPU time and peak memory of the
whole command at growing PP (micro-batches = 2 x PP), each in a fresh process measured by
``/usr/bin/time -v``, with the time per action side by side (flat: linear cost).

    python bench/simulate_scale.py              # PP 64, 128, 256, 512, 1000
    python bench/simulate_scale.py 256 1000     # chosen sizes

Figures in docs/schedules.md. Needs GNU time (``/usr/bin/time``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_dualpipe.schedules.registry import generate  # noqa: E402

FIELDS = {
    "wall": r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)",
    "user": r"User time \(seconds\): (\S+)",
    "system": r"System time \(seconds\): (\S+)",
    "rss_kb": r"Maximum resident set size \(kbytes\): (\d+)",
}


def _seconds(clock: str) -> float:
    parts = [float(x) for x in clock.split(":")]
    return sum(x * 60**i for i, x in enumerate(reversed(parts)))


def measure(pp: int, schedule: str = "dualpipev") -> dict[str, float]:
    """One ``simulate`` command at PP=pp with 2 x PP micro-batches, timed from outside."""
    command = [sys.executable, "-m", "megatron_dualpipe", "simulate", "--schedule", schedule]
    command += ["--pp", str(pp), "--microbatches", str(2 * pp)]
    done = subprocess.run(
        ["/usr/bin/time", "-v", *command], cwd=ROOT, capture_output=True, text=True, check=True
    )
    found = {k: re.search(pattern, done.stderr).group(1) for k, pattern in FIELDS.items()}
    return {
        "wall_s": _seconds(found["wall"]),
        "cpu_s": float(found["user"]) + float(found["system"]),
        "rss_mb": int(found["rss_kb"]) / 1024,
    }


def main(sizes: list[int]) -> None:
    header = ("PP", "actions", "wall s", "cpu s", "peak MB", "cpu us/action")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (5, 10, 7, 7, 8, 14), strict=True)))
    for pp in sizes:
        actions = sum(map(len, generate("dualpipev", pp, 2 * pp).ranks))
        m = measure(pp)
        per_action = 1e6 * m["cpu_s"] / actions
        print(
            f"{pp:>5} {actions:>10,} {m['wall_s']:>7.1f} {m['cpu_s']:>7.1f} "
            f"{m['rss_mb']:>8.0f} {per_action:>14.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [64, 128, 256, 512, 1000])
