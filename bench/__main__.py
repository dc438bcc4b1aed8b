"""``python -m bench`` (from the checkout's root): every schedule, simulated on a grid and
measured; the work is :func:`bench.run`. Each error is one sentence on stderr and exit
status 2, as a ``megatron-dualpipe`` command's."""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

from megatron_dualpipe.cli.command import quiet_exit, run_command
from megatron_dualpipe.cli.common import check_outputs
from megatron_dualpipe.schedules.ir import ScheduleError

from . import SECTIONS, run

__all__ = ["main"]

PROG = "python -m bench"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
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
    return p


def _run(args: argparse.Namespace) -> None:
    check_outputs({"--json": args.json})
    if args.out is not None:
        if args.out.exists() and not args.out.is_dir():
            raise ScheduleError(
                f"--out: {args.out} is a file: name a folder for BENCHMARKS.md and the figures"
            )
        check_outputs({"--out": args.out / "BENCHMARKS.md"} if args.out.is_dir() else {})
    sections = tuple(args.only) if args.only else None
    run(quick=args.quick, json_path=args.json, out_dir=args.out, sections=sections)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: this process's command line); its exit
    status. Run as the command, it exits as ``megatron-dualpipe`` does (``gc.freeze``, and
    nothing the interpreter's shutdown prints after the last line)."""
    code = _main(argv)
    if argv is None:
        gc.freeze()
        quiet_exit()
    return code


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    return run_command(PROG, "bench", lambda: _run(args))


if __name__ == "__main__":
    sys.exit(main())
