"""What a checkpoint directory holds on disk, read without any process group.

Megatron-LM's layout: ``<root>/iter_0000005/`` per saved iteration and
``<root>/latest_checkpointed_iteration.txt`` naming the newest complete one (written after
every rank saved, atomically). An iteration directory of dist_checkpointing's
``torch_dist`` format is complete when its ``metadata.json`` names that format, its common
state and ``.metadata`` can be read, and every shard file ``.metadata`` indexes is there at
its full length. The common state is ``common.pt`` where megatron-core writes one (before
0.19; 0.19 reads it still) and a ShardedObject inside the shards otherwise
(:func:`~..version.common_state_in_dcp`). Shards with the right length but damaged
contents are only found when they are read (:func:`load_failure`).

Every problem is one :class:`CheckpointError` sentence naming the directory, the file,
what is wrong and what to do (load an earlier iteration with ``ckpt_step``, Megatron-LM's
key, naming the complete ones).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path

from megatron.core import dist_checkpointing
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from ..version import common_state_in_dcp
from .errors import TrainError

__all__ = [
    "COMMON_PT",
    "TRACKER",
    "CheckpointError",
    "complete_iterations",
    "damage",
    "earlier_advice",
    "failure_cause",
    "iteration_dir",
    "iterations",
    "read_tracker",
    "unwritable",
    "write_tracker",
    "writer_errors",
]

TRACKER = "latest_checkpointed_iteration.txt"
COMMON_PT = "common.pt"
_ITERATION = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(TrainError):
    """A checkpoint that cannot be saved or loaded into this run; the message says why."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def read_tracker(root: str | Path) -> int | None:
    """The iteration the tracker file under ``root`` names, or None without one."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text(encoding="utf-8", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{tracker}: expected an iteration number, found {text[:40]!r}: {earlier_advice(root)}"
        )
    return int(text)


def write_tracker(root: str | Path, iteration: int) -> None:
    """Name ``iteration`` the latest in ``root``; atomic, so a kill leaves the old one."""
    tracker = Path(root) / TRACKER
    partial = tracker.with_name(f".{TRACKER}.{os.getpid()}")
    partial.write_text(f"{iteration}\n", encoding="utf-8")
    os.replace(partial, tracker)


def iterations(root: str | Path) -> list[int]:
    """The iterations with a directory under ``root``, complete or not, oldest first."""
    found = []
    if Path(root).is_dir():
        for entry in Path(root).iterdir():
            match = _ITERATION.match(entry.name)
            if match and entry.is_dir():
                found.append(int(match.group(1)))
    return sorted(found)


def damage(directory: Path) -> str | None:
    """What keeps the checkpoint in ``directory`` from loading ("<file> is missing", "<file>
    is truncated ...", "<file> cannot be read (...)"), or None if it looks complete."""
    if not directory.is_dir():
        return "the directory does not exist"
    legacy = (directory / COMMON_PT).is_file() or not common_state_in_dcp()
    for name in ("metadata.json", COMMON_PT, ".metadata"):
        if not (directory / name).is_file() and (name != COMMON_PT or legacy):
            return f"{name} is missing"
    try:
        backend = json.loads((directory / "metadata.json").read_text(encoding="utf-8"))
        if backend.get("sharded_backend") != "torch_dist":
            raise ValueError(f"sharded backend {backend.get('sharded_backend')!r}")
    except (ValueError, AttributeError, UnicodeDecodeError) as err:
        return f"metadata.json cannot be read ({_first_line(err)})"
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
        needed: dict[str, int] = defaultdict(int)
        for info in metadata.storage_data.values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed[info.relative_path], end)
    except Exception as err:  # unpickling damaged bytes raises many kinds
        return f".metadata cannot be read ({_first_line(err)})"
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        have = path.stat().st_size
        if have < size:
            return f"{name} is truncated ({have} of its {size} bytes)"
    try:
        dist_checkpointing.load_common_state_dict(str(directory))
    except (Exception, CheckpointException) as err:  # damaged bytes raise many kinds
        common = COMMON_PT if legacy else "the common state (in the shards)"
        return f"{common} cannot be read ({_first_line(_cause(err))})"
    return None


def complete_iterations(root: str | Path) -> list[int]:
    """The iterations under ``root`` whose directories look complete, oldest first."""
    return [i for i in iterations(root) if damage(iteration_dir(root, i)) is None]


def earlier_advice(root: str | Path, *, before: int | None = None) -> str:
    """What to do instead: load a complete iteration (before ``before``) or start over."""
    complete = [i for i in complete_iterations(root) if before is None or i < before]
    if not complete:
        return f"there is no complete checkpoint in {root}: unset load to train from scratch"
    listed = ", ".join(map(str, complete))
    return (
        f"load an earlier iteration with ckpt_step (complete checkpoints in {root}: "
        f"iteration{'s' if len(complete) > 1 else ''} {listed})"
    )


def unwritable(path: str | Path) -> str | None:
    """Why this process cannot create files under ``path`` (made if missing), or None."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test.{os.getpid()}"
        probe.write_bytes(b"megatron-dualpipe")
        probe.unlink()
    except OSError as err:
        return err.strerror or str(err)
    return None


#: The logger of megatron-core's checkpoint writer: from 0.17 a failing writer worker is
#: raised as ``AssertionError(<class 'OSError'>)``, its error only logged here.
_WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@contextlib.contextmanager
def writer_errors() -> Iterator[list[str]]:
    """The errors megatron-core's checkpoint writer logs while the block runs (a list that
    fills as they come), for :func:`failure_cause`."""
    logged: list[str] = []
    handler = _Collect(logged)
    logger = logging.getLogger(_WRITER_LOGGER)
    logger.addHandler(handler)
    try:
        yield logged
    finally:
        logger.removeHandler(handler)


def failure_cause(err: BaseException, logged: Sequence[str] = ()) -> tuple[list[int], str]:
    """The ranks and the one-line cause behind a dist_checkpointing failure (torch's
    CheckpointException gathers each failing rank's exception); ENOSPC reads as "no space
    left on device", also when only the writer's ``logged`` errors name it."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = {rank: _unwrap(failure) for rank, failure in failures.items()}
        ranks = sorted(causes)
        return ranks, _cause_text(causes[ranks[0]], logged)
    return [], _cause_text(err, logged)


def _cause(err: BaseException) -> BaseException | object:
    """The first failing rank's exception inside torch's CheckpointException (which is not an
    ``Exception``: it derives from ``BaseException``), else ``err``."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        return _unwrap(failures[min(failures)])
    return err


def _unwrap(failure: object) -> BaseException | object:
    """torch wraps each rank's exception with its traceback: (exception, traceback)."""
    if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
        return failure[0]
    return failure


def _cause_text(err: BaseException | object, logged: Sequence[str] = ()) -> str:
    seen: set[int] = set()
    current: BaseException | None = err if isinstance(err, BaseException) else None
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return "no space left on device"
        current = current.__cause__ or current.__context__
    if any("No space left on device" in text for text in (str(err), *logged)):
        return "no space left on device"
    return _first_line(err)


def _first_line(err: BaseException | object) -> str:
    """``Type: first sentence`` of an exception's message, at most about 120 characters."""
    text = " ".join(str(err).split())
    sentence = text.split(". ", 1)[0].rstrip(".")
    if len(sentence) > 120:
        sentence = sentence[:117] + "..."
    return f"{type(err).__name__}: {sentence}" if sentence else type(err).__name__
