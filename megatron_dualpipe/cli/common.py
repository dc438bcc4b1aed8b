"""What several commands share: unwinding on SIGTERM and SIGHUP as on Ctrl-C, the check
that an output can be written, Megatron-LM's ``--json-keys``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from ..schedules.ir import ScheduleError

__all__ = [
    "Terminated",
    "add_json_keys",
    "add_overrides",
    "check_outputs",
    "unwind_on_stop_signals",
]


class Terminated(BaseException):
    """SIGTERM or SIGHUP (a closed terminal or ssh session) arrived: unwind like Ctrl-C,
    so the embedded launcher kills its ranks."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminate(signum: int, frame: object) -> None:
    """Raise :class:`Terminated`; from here on a child's death is the stop's doing, not a
    fault to report: SIGCHLD goes back to its default, for torch's DataLoader handler
    (``torch.utils.data._utils.signal_handling._set_SIGCHLD_handler``) raises a
    ``RuntimeError`` over the unwinding when srun's SIGTERM, which reaches every process of
    a task, ends a worker. A worker that the same signal ended first may still run that
    handler here, before the switch takes effect: its error names that ending, so the switch
    is made again."""
    while True:
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            break
        except RuntimeError:  # torch's handler, for a worker this stop has ended
            continue
    raise Terminated(signum)


#: Signals ``train`` and ``preprocess`` unwind on, as on Ctrl-C, unless started with them
#: ignored.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def unwind_on_stop_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`Terminated` (Ctrl-C's unwinding:
    launched ranks killed, partial files removed), unless the command was started with them
    ignored; the previous handlers are back on leaving it."""
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum, handler in previous.items():
        if handler != signal.SIG_IGN:  # nohup's SIGHUP stays ignored: the run goes on
            signal.signal(signum, _terminate)
    try:
        yield
    finally:  # a signal while the error is printed must not interrupt the printing
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def check_outputs(paths: dict[str, Path | None]) -> None:
    """Refuse, before any work, an output (flag: path) this process cannot create: its
    folder missing or unwritable, or the path a folder."""
    for flag, path in paths.items():
        if path is None:
            continue
        if path.is_dir():
            raise ScheduleError(f"{flag}: {path} is a folder: name a file in it")
        probe = path.parent / f".{path.name}.{os.getpid()}.probe"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise ScheduleError(
                f"{flag}: cannot write {path} ({err.strerror or err}): name a file in a folder "
                "you can write to"
            ) from None


def add_json_keys(p: argparse.ArgumentParser, what: str) -> None:
    """Megatron-LM's ``--json-keys`` (default: text)."""
    p.add_argument(
        "--json-keys", nargs="+", default=["text"], metavar="KEY", help=f"{what} (default: text)"
    )


def add_overrides(p: argparse.ArgumentParser, what: str) -> None:
    """``--set KEY=VALUE`` (repeatable), into ``args.overrides``."""
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=what
    )
