"""One run per save directory: a lock the run holds on ``save`` from its start to its end.

Two runs saving to one directory overwrite each other's iterations and tracker; each
would still report "checkpoints in ...". The lock is ``flock`` on ``<save>/.megatron-
dualpipe.lock``, which the kernel releases when the last process holding it ends, however
it ends (``kill -9`` included): a lock file left by a dead run locks nothing and the next
run takes it over, whatever pid it names; a run that ends removes it. The file names the
holder (pid, host, start time) for the refusal; the embedded launcher's ranks inherit the
lock, so it lasts while any process of the run does. Under torchrun or srun, global rank 0
holds it.

Where the file system has no ``flock`` (some network file systems), the run goes on
without the lock and says so in one line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from ...errors import DualPipeError
from ...runtime.launch import process_exists

__all__ = ["LOCK_NAME", "SaveDirectoryInUse", "save_lock"]

LOCK_NAME = ".megatron-dualpipe.lock"
logger = logging.getLogger(__name__)
#: flock's answers where the file system does not support it.
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class SaveDirectoryInUse(DualPipeError, RuntimeError):
    """Another run holds the save directory's lock; the message names it."""


@contextlib.contextmanager
def save_lock(save: str | Path) -> Iterator[None]:
    """Hold ``save``'s lock for the ``with`` block; :class:`SaveDirectoryInUse` naming the
    other run when one holds it. The lock file is removed at the end. A directory that cannot
    be made is left to the writable check, which names the reason on every rank."""
    directory = Path(save)
    path = directory / LOCK_NAME
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = _locked(path)
    except SaveDirectoryInUse:
        raise
    except OSError as err:
        if err.errno not in _NO_FLOCK:
            yield  # the writable check names it
            return
        logger.warning("save: %s cannot be locked (%s): not checked for other runs",
                       directory, err.strerror)  # fmt: skip
        yield
        return
    try:
        _record_holder(path)
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # before the lock goes: a run that takes it sees the file anew
        os.close(fd)


def _locked(path: Path) -> int:
    """An open descriptor of ``path`` holding its ``flock``; :class:`SaveDirectoryInUse`
    when another run holds it. Opened read-only: ``flock`` needs no write access, and a file
    system with a file open for writing cannot be remounted read-only (as must stay
    possible mid-run). A file removed by its last holder while this process waited for it is
    not the lock any more: then the one now at ``path`` is taken."""
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise SaveDirectoryInUse(_in_use(path.parent, holder)) from None
        except OSError:
            os.close(fd)
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _record_holder(path: Path) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with contextlib.suppress(OSError):  # the lock holds without the note
        path.write_text(f"{os.getpid()} {socket.gethostname()} {stamp}\n", encoding="utf-8")


def _holder(fd: int) -> tuple[int | None, str, str]:
    """(pid, host, start) of the run the lock file names; None and '' where unreadable."""
    try:
        fields = os.pread(fd, 256, 0).decode("utf-8", "replace").split(maxsplit=2)
        return int(fields[0]), fields[1], fields[2].strip()
    except (OSError, ValueError, IndexError):
        return None, "", ""


def _in_use(directory: Path, holder: tuple[int | None, str, str]) -> str:
    pid, host, started = holder
    if pid is None:
        who = "another run"
    else:
        since = f", started {started}" if started else ""
        who = f"another run (pid {pid} on {host}{since})"
        if host == socket.gethostname() and not process_exists(pid):
            who = (
                f"what is left of a run whose launcher (pid {pid}{since}) has exited: end its "
                f"processes (fuser -v {directory / LOCK_NAME} lists them)"
            )
    return (
        f"save: {directory} is in use by {who}: wait for it to finish, or set save to "
        "another directory"
    )
