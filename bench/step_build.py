"""What building one training step's schedule costs a rank, by micro-batch count.

Before its first step every rank of ``train`` builds the whole step: the schedule's
generation, the executor's validation (:func:`~megatron_dualpipe.schedules.validate.validate`
and the dW-order check) and its communication plan (lowering included). This bench runs
exactly those, for one schedule at one PP, in a fresh process per micro-batch count, and
prints each phase's time and the process's peak resident memory above its start, per
micro-batch and per PP x micro-batch (the unit of ``schedules/limits.py``).

    python bench/step_build.py                         # dualpipev, PP=2, 2k to 64k
    python bench/step_build.py --schedule 1f1b --pp 4 1000 10000

Figures in docs/reliability.md and ``limits.py`` (``TRAIN_BYTES_PER_UNIT``,
``TRAIN_SECONDS_PER_UNIT``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_dualpipe.schedules.comm_plan import comm_plan  # noqa: E402
from megatron_dualpipe.schedules.limits import schedule_size  # noqa: E402
from megatron_dualpipe.schedules.registry import spec  # noqa: E402
from megatron_dualpipe.schedules.validate import (  # noqa: E402
    check_weight_grads_in_b_order,
    validate,
)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_once(schedule: str, pp: int, microbatches: int) -> dict[str, float]:
    """Build one step as a rank does, here; each phase's seconds and the peak memory
    added (MB)."""
    base = _peak_mb()
    found = spec(schedule)
    times: dict[str, float] = {}
    began = time.perf_counter()
    generated = found.generate(pp, microbatches)
    times["generate_s"] = time.perf_counter() - began
    began = time.perf_counter()
    checked = validate(generated)
    check_weight_grads_in_b_order(checked)
    times["validate_s"] = time.perf_counter() - began
    began = time.perf_counter()
    comm_plan(checked)
    times["plan_s"] = time.perf_counter() - began
    times["total_s"] = sum(times.values())
    times["peak_mb"] = _peak_mb() - base
    return times


def measure(schedule: str, pp: int, microbatches: int) -> dict[str, float]:
    """:func:`build_once` in a fresh interpreter (so each peak is its own)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from bench.step_build import "
        "build_once; print(json.dumps(build_once(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))"
    )
    args = [sys.executable, "-c", code, str(ROOT), schedule, str(pp), str(microbatches)]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="dualpipev")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("microbatches", type=int, nargs="*", default=[2000, 8000, 32000, 64000])
    args = parser.parse_args()
    print(
        f"{args.schedule}, PP={args.pp}: micro-batches, generate / validate / plan / total s, "
        "peak MB, and per PP x micro-batch: us, KB"
    )
    for m in args.microbatches:
        got = measure(args.schedule, args.pp, m)
        units = schedule_size(args.pp, m, spec(args.schedule).chunks)
        print(
            f"{m:>9,}  {got['generate_s']:7.2f} {got['validate_s']:7.2f} {got['plan_s']:7.2f} "
            f"{got['total_s']:7.2f} s  {got['peak_mb']:8.1f} MB  "
            f"{1e6 * got['total_s'] / units:6.1f} us  {1024 * got['peak_mb'] / units:6.2f} KB"
        )


if __name__ == "__main__":
    main()
