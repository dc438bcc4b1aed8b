"""Measured on sleep stages with the "uneven" profile (the first and the last model stage
1.5x: embedding, output layer and loss; ``--end-scale 1`` for F=B=W), in one run:
DualPipeV optimised for this machine's calibrated costs against the hand-made DualPipeV,
torch's ZBV and DualPipeV and Megatron's 1F1B, as per-round ratios; and every schedule's
measured / simulated step with the calibrated P2P latency and per-action overhead.

    python bench/measured_optimised.py                 # PP=4, 16 micro-batches, 3 launches
    python bench/measured_optimised.py --launches 1    # quicker, noisier
    python bench/measured_optimised.py --end-scale 1   # even stages

Figures in docs/optimizer.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_dualpipe.bench.measured import (  # noqa: E402
    BASELINE,
    OPTIMISED,
    MeasuredConfig,
    measure,
)
from megatron_dualpipe.bench.measured_report import measured_table  # noqa: E402
from megatron_dualpipe.schedules import generate, simulate  # noqa: E402
from megatron_dualpipe.schedules.optimize import Effort, optimize  # noqa: E402
from megatron_dualpipe.schedules.report import markdown_table  # noqa: E402

PEERS = ("torch-zbv", "torch-dualpipev", "dualpipev")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--share-ms", type=float, default=20.0)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--end-scale", type=float, default=1.5, help="first/last stage x this (1: F=B=W)"
    )
    args = parser.parse_args(argv)
    config = MeasuredConfig(
        pp=args.pp,
        microbatches=args.microbatches,
        share_ms=args.share_ms,
        launches=args.launches,
        steps=args.steps,
        schedules=(BASELINE, *PEERS, OPTIMISED),
        timeline=None,
        end_scale=args.end_scale,
        calibrate=True,
    )
    run = measure(config, verbose=True)
    cal = run.calibration
    print(
        f"\ncalibrated on this machine: P2P latency {cal.latency_ms:.3f} ms (gloo ping-pong, "
        f"median), per-action overhead {cal.overhead_ms:.3f} ms (F, B, W of our executor "
        "beyond their sleep); load average "
        f"{run.load_before[0]:.1f} before, {run.load_after[0]:.1f} after\n"
    )
    print(measured_table(run) + "\n")
    hand = generate("dualpipev", args.pp, args.microbatches)
    cost = config.cost_for(hand.placement, cal)
    result = optimize(hand.placement, cost, time_limit=60.0, effort=Effort())
    same = result.schedule.ranks == hand.ranks
    print(
        f"simulated with the calibrated costs: hand dualpipev {simulate(hand, cost).makespan:.1f} "
        f"ms, optimised {result.makespan:.1f} ms, lower bound {result.lower_bound:.1f} ms "
        f"(gap {100 * result.gap:.2f}%); the optimised order "
        + ("IS the hand-made one (nothing faster exists or was found)" if same else "differs")
        + "\n"
    )
    rows = []
    for other in (*PEERS, BASELINE):
        low, high = run.ratio_range(OPTIMISED, other)
        rows.append([f"{OPTIMISED} / {other}", f"{run.ratio(OPTIMISED, other):.3f}",
                     f"{low:.3f}-{high:.3f}"])  # fmt: skip
    print(markdown_table(["step-time ratio (median over rounds)", "ratio", "range"], rows))
    ahead = [o for o in (*PEERS, BASELINE) if run.ratio(OPTIMISED, o) < 1.0]
    behind = [o for o in (*PEERS, BASELINE) if o not in ahead]
    print(
        f"\n{OPTIMISED} is ahead of every other schedule in this run"
        if not behind
        else f"\n{OPTIMISED} is NOT ahead of: {', '.join(behind)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
