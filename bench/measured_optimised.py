"""Measured on sleep stages with the "uneven" profile (the first and the last model stage
1.5x: embedding, output layer and loss; ``--end-scale 1`` for F=B=W), in one run: each
optimised order (:data:`OPTIMISED_PEERS`: DualPipeV's V, and the loop of ZB-H1 and
interleaved 1F1B) against the schedules of its placement and Megatron's 1F1B, as per-round
ratios; and every schedule's measured / simulated step with the calibrated P2P latency
and per-action overhead.

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

from bench.measured import (  # noqa: E402
    BASELINE,
    OPTIMISED_PEERS,
    MeasuredConfig,
    MeasuredRun,
    measure,
)
from bench.measured_report import measured_table  # noqa: E402
from megatron_dualpipe.planner.report import markdown_table  # noqa: E402


def _verdict(run: MeasuredRun, name: str) -> str:
    """Ratios of ``name`` over its peers and the baseline, then whether it led each of them
    in every round (a median below 1 whose per-round range reaches 1 is no clear lead)."""
    by_name = run.by_name()
    others = [*OPTIMISED_PEERS[name], BASELINE]
    predicted = min(by_name[o].simulated_ms for o in OPTIMISED_PEERS[name])
    rows = []
    for other in others:
        low, high = run.ratio_range(name, other)
        rows.append([f"{name} / {other}", f"{run.ratio(name, other):.3f}",
                     f"{low:.3f}-{high:.3f}"])  # fmt: skip
    unclear = [o for o in others if run.ratio_range(name, o)[1] >= 1.0]
    return (
        f"simulated with the calibrated costs: {name} {by_name[name].simulated_ms:.1f} ms, "
        f"its fastest peer {predicted:.1f} ms\n\n"
        + markdown_table(["step-time ratio (median over rounds)", "ratio", "range"], rows)
        + (
            f"\n\n{name} is ahead of every other schedule of its placement in every round"
            if not unclear
            else f"\n\n{name} is not ahead in every round of: {', '.join(unclear)}"
        )
    )


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
    peers = [p for name in OPTIMISED_PEERS for p in OPTIMISED_PEERS[name]]
    config = MeasuredConfig(
        pp=args.pp,
        microbatches=args.microbatches,
        share_ms=args.share_ms,
        launches=args.launches,
        steps=args.steps,
        schedules=(BASELINE, *dict.fromkeys(peers), *OPTIMISED_PEERS),
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
    for name in OPTIMISED_PEERS:
        print(_verdict(run, name) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
