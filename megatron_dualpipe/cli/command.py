"""The top parser and :func:`main`: each command's module adds its parser and runs it;
here, every error becomes one sentence on stderr and an exit status."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import sys
from collections.abc import Callable

from .. import __version__
from ..errors import DualPipeError
from . import make_tokenizer, patch_megatron_lm, preprocess, simulate, train
from .common import Terminated

__all__ = ["main", "quiet_exit", "run_command"]

#: The commands in ``--help``'s order: each module's ``add(sub)`` and ``run(args)``.
COMMANDS = {
    "simulate": simulate,
    "train": train,
    "preprocess": preprocess,
    "make-tokenizer": make_tokenizer,
    "patch-megatron-lm": patch_megatron_lm,
}


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default: this process's command line) and return its
    exit status. Run as the command, it leaves its objects out of the interpreter's last
    garbage collections (``gc.freeze``): torch's and Megatron's module graphs made the exit
    take 4 to 10 s on a loaded machine, after the work was done; and what the interpreter's
    shutdown writes to stderr after the command's last line is dropped (:func:`quiet_exit`)."""
    code = _main(argv)
    if argv is None:
        gc.freeze()
        quiet_exit()
    return code


def quiet_exit() -> None:
    """Point stderr at the null device once the command's work and output are done, so
    that its last line stays the last: torch 2.15 loads Triton, whose nanobind bindings
    print some 30 lines of "nanobind: leaked ..." when the interpreter tears them down."""
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stderr.fileno())
        os.close(null)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-dualpipe",
        description="DualPipe and DualPipeV pipeline schedules for Megatron-Core: simulate a "
        "schedule, train a GPT with one. Each command's --help says more.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add(sub)
    args = parser.parse_args(argv)
    return run_command("megatron-dualpipe", args.command, lambda: COMMANDS[args.command].run(args))


def run_command(prog: str, command: str, work: Callable[[], None]) -> int:
    """Run ``work``, the command ``command`` of ``prog``; its exit status. Each way it can
    fail ends in one line on stderr: an error of ours or of the file system (2), a signal
    (128 + its number; 130 for Ctrl-C), torch or megatron-core not installed (2), the
    reader of the output gone (1)."""
    try:
        work()
    except KeyboardInterrupt:
        # The embedded launchers kill every rank they started on the way out.
        print(f"{prog}: {command} interrupted", file=sys.stderr)
        return 130
    except Terminated as stop:
        name = signal.Signals(stop.signum).name
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            fault = _fault_before(stop)
            if fault is not None:
                print(f"{prog}: error: {fault}", file=sys.stderr)
            print(f"{prog}: {command} terminated ({name})", file=sys.stderr)
        return 128 + stop.signum
    except BrokenPipeError:  # the reader of our output went away (| head)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the interpreter's final flush
        return 1
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] not in ("torch", "megatron"):
            raise
        print(
            f"{prog}: error: {command} needs torch and megatron-core, and {err.name} is not "
            "installed: from the megatron-dualpipe checkout (it is not on PyPI), pip install "
            "-e '.[megatron]' (or install your own CUDA build of torch first)",
            file=sys.stderr,
        )
        return 2
    except (DualPipeError, OSError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _fault_before(stop: Terminated) -> DualPipeError | None:
    """The error this process was unwinding from when ``stop`` arrived, if one of ours: a
    rank that lost its peer reports it, and then srun's SIGTERM to the whole step stops it."""
    cause = stop.__context__
    while cause is not None and not isinstance(cause, DualPipeError):
        cause = cause.__context__
    return cause
