"""``megatron-dualpipe bench``: every schedule, simulated on a grid and measured; the work
is :func:`megatron_dualpipe.bench.run`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..bench import SECTIONS
from ..schedules.ir import ScheduleError
from .common import check_outputs

__all__ = ["add", "run"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark every schedule: simulated grid and measured runs",
        description="Simulate every schedule (ours and torch.distributed.pipelining's) on a "
        "grid of PP, micro-batches and cost profiles, then measure ours, Megatron's and "
        "torch's runtimes side by side on sleep-op stages; print tables as it goes.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="about two minutes: PP 4 and 8 in the grid, fewer measured rounds, no separate "
        "torch-peers section",
    )
    p.add_argument("--json", type=Path, help="write every section's figures as JSON")
    p.add_argument("--out", type=Path, help="folder for BENCHMARKS.md and the figures")
    p.add_argument(
        "--only",
        action="append",
        choices=list(SECTIONS),
        help="run only this section (repeatable); default: all",
    )


def run(args: argparse.Namespace) -> None:
    from ..bench import run as run_bench  # the bench sections import torch only when they run

    check_outputs({"--json": args.json})
    if args.out is not None:
        if args.out.exists() and not args.out.is_dir():
            raise ScheduleError(
                f"--out: {args.out} is a file: name a folder for BENCHMARKS.md and the figures"
            )
        check_outputs({"--out": args.out / "BENCHMARKS.md"} if args.out.is_dir() else {})
    sections = tuple(args.only) if args.only else None
    run_bench(quick=args.quick, json_path=args.json, out_dir=args.out, sections=sections)
