"""What a checkpoint directory holds on disk, read without any process group.

Megatron-LM's layout: ``<root>/iter_0000005/`` per saved iteration and
``<root>/latest_checkpointed_iteration.txt`` naming the newest complete one (written after
every rank saved, atomically). An iteration directory of dist_checkpointing's
``torch_dist`` format is complete when its ``metadata.json`` names that format, its common
state and ``.metadata`` can be read, every shard file ``.metadata`` indexes is there at its
full length, and the shards' objects other than tensors load. The common state is
``common.pt`` where megatron-core writes one (before 0.19; 0.19 reads it still) and a
ShardedObject inside the shards otherwise (:func:`~..compat.version.common_state_in_dcp`).
Nothing is read in a way that could run code from the files (:mod:`.trust`):
the shards' objects and the index are checked before megatron-core's reader reads a common
state kept among them, and a storage file the index names outside the directory (absolute,
with ``..``, or a symlink out) is refused before anything is read from it. Shards with the
right length but damaged tensors are only found when the ranks read them.

Every problem is one :class:`CheckpointError` sentence naming the directory, the file,
what is wrong and what to do (load an earlier iteration with ``ckpt_step``, Megatron-LM's
key, naming the complete ones).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ...errors import DualPipeError
from ..compat.version import common_state_in_dcp
from .trust import UntrustedPickle, load_weights_only, read_metadata

__all__ = [
    "COMMON_PT",
    "TRACKER",
    "CheckpointError",
    "Contents",
    "Damaged",
    "check_fresh_save",
    "complete_iterations",
    "contents",
    "damage",
    "earlier_advice",
    "failure_cause",
    "iteration_dir",
    "iterations",
    "read_tracker",
    "write_tracker",
    "writer_errors",
]

TRACKER = "latest_checkpointed_iteration.txt"
COMMON_PT = "common.pt"
_ITERATION = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(DualPipeError, RuntimeError):
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


@dataclass(frozen=True)
class Contents:
    """What a complete-looking checkpoint directory holds, read without running code from it
    (:mod:`.trust`): its common state and torch.distributed.checkpoint's index."""

    common: dict[str, Any]
    metadata: Metadata


class Damaged(DualPipeError, RuntimeError):
    """What keeps a checkpoint directory from loading, as a clause: "<file> is missing",
    "<file> is truncated ...", "<file> cannot be read (...)", "<file> refers to ..."."""


def contents(directory: Path) -> Contents:
    """Read ``directory``'s common state and index, and check that every shard the index
    names is there at its full length and that its objects other than tensors load without
    running code; :class:`Damaged` otherwise."""
    if not directory.is_dir():
        raise Damaged("the directory does not exist")
    legacy = (directory / COMMON_PT).is_file() or not common_state_in_dcp()
    for name in ("metadata.json", COMMON_PT, ".metadata"):
        if not (directory / name).is_file() and (name != COMMON_PT or legacy):
            raise Damaged(f"{name} is missing")
    try:
        backend = json.loads((directory / "metadata.json").read_text(encoding="utf-8"))
        if backend.get("sharded_backend") != "torch_dist":
            raise ValueError(f"sharded backend {backend.get('sharded_backend')!r}")
    except (ValueError, AttributeError, UnicodeDecodeError) as err:
        raise Damaged(f"metadata.json cannot be read ({_first_line(err)})") from None
    metadata = _read(directory, ".metadata", read_metadata)
    needed: dict[str, int] = defaultdict(int)
    try:
        for info in metadata.storage_data.values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed[info.relative_path], end)
    except (AttributeError, TypeError) as err:
        raise Damaged(f".metadata cannot be read ({_first_line(err)})") from None
    for name in sorted(needed, key=str):
        _check_inside(directory, name)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            raise Damaged(f"{name} is missing")
        have = path.stat().st_size
        if have < size:
            raise Damaged(f"{name} is truncated ({have} of its {size} bytes)")
    _check_objects(directory, metadata)
    common = _read(directory, COMMON_PT, load_weights_only) if legacy else _common_in(directory)
    if not isinstance(common, dict):
        raise Damaged(f"the common state holds a {type(common).__name__}, not a checkpoint's")
    return Contents(common, metadata)


def _check_inside(directory: Path, name: object) -> None:
    """:class:`Damaged` unless the storage file ``name`` (a ``_StorageInfo.relative_path``,
    which torch's ``FileSystemReader`` joins to the checkpoint's path and reads) is a
    relative path that stays in ``directory``, symlinks resolved; checked before it is
    opened."""
    parts = Path(name).parts if isinstance(name, str) else ()
    inside = bool(parts) and not Path(name).is_absolute() and ".." not in parts
    if inside:
        root = directory.resolve()
        inside = (directory / name).resolve().is_relative_to(root)
    if not inside:
        raise Damaged(
            f".metadata names the storage file {name!r}, which is not inside the checkpoint "
            "directory (nothing was read from it)"
        )


def _common_in(directory: Path) -> dict[str, Any]:
    """The common state megatron-core 0.19 keeps among the shards, read by megatron-core
    once the shards' objects and the index are known to run no code."""
    try:
        return dist_checkpointing.load_common_state_dict(str(directory))
    except (Exception, CheckpointException) as err:  # damaged bytes raise many kinds
        cause = _first_line(_cause(err))
        raise Damaged(f"the common state (in the shards) cannot be read ({cause})") from None


def _read(directory: Path, name: str, reader: Callable[[Path], Any]) -> Any:
    try:
        return reader(directory / name)
    except UntrustedPickle as err:
        raise Damaged(f"{name} {err} (nothing of it was run)") from None
    except Exception as err:  # unpickling damaged bytes raises many kinds
        raise Damaged(f"{name} cannot be read ({_first_line(err)})") from None


def _check_objects(directory: Path, metadata: Metadata) -> None:
    """Load every object of the shards that is not a tensor (torch's loader reads them with
    ``weights_only=False``) the safe way first; :class:`Damaged` naming the first refused."""
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        where = f"{info.relative_path} (its object {index.fqn})"
        if getattr(info, "transform_descriptors", None):
            raise Damaged(f"{where} is stored with transforms this check cannot read")
        with (directory / info.relative_path).open("rb") as stream:
            stream.seek(info.offset)
            data = stream.read(info.length)
        try:
            load_weights_only(io.BytesIO(data))
        except UntrustedPickle as err:
            raise Damaged(f"{where} {err} (nothing of it was run)") from None
        except Exception as err:
            raise Damaged(f"{where} cannot be read ({_first_line(err)})") from None


def damage(directory: Path) -> str | None:
    """What keeps the checkpoint in ``directory`` from loading (:class:`Damaged`'s clause),
    or None if it looks complete."""
    try:
        contents(directory)
    except Damaged as err:
        return str(err)
    return None


def complete_iterations(root: str | Path) -> list[int]:
    """The iterations under ``root`` whose directories look complete, oldest first."""
    return [i for i in iterations(root) if damage(iteration_dir(root, i)) is None]


def check_fresh_save(save: str | Path | None, load: str | Path | None) -> None:
    """Raise :class:`CheckpointError` when ``save`` already holds complete checkpoints and
    the run does not load from it (``load`` None or elsewhere): its saves would overwrite
    another run's checkpoints and leave the folder mixed. Incomplete iteration directories
    (what a killed save leaves) are overwritten, as Megatron-LM overwrites them
    (dist_checkpointing's save warns "Overwriting old incomplete / corrupted checkpoint").
    Reads only files."""
    if save is None:
        return
    root = Path(save)
    if load is not None and Path(load).resolve() == root.resolve():
        return
    complete = complete_iterations(root)
    if not complete:
        return
    listed = f"iteration{'s' if len(complete) > 1 else ''} {', '.join(map(str, complete))}"
    loads = f"loads from {load}" if load is not None else "does not load from it"
    raise CheckpointError(
        f"save: {root} holds complete checkpoints of another run ({listed}) and this run "
        f"{loads}, so its saves would overwrite them: resume that run with load: {root} "
        "(load and save one folder), or choose another save"
    )


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


def failure_cause(
    err: BaseException, logged: Sequence[str] = (), directory: str | Path | None = None
) -> tuple[list[int], str]:
    """The ranks and the one-line cause behind a dist_checkpointing failure (torch's
    CheckpointException gathers each failing rank's exception); ENOSPC reads as "no space
    left on device", also when only the writer's ``logged`` errors name it, and so does a
    short write without an errno where ``directory`` (the save directory) is full."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = {rank: _unwrap(failure) for rank, failure in failures.items()}
        ranks = sorted(causes)
        return ranks, _cause_text(causes[ranks[0]], logged, directory)
    return [], _cause_text(err, logged, directory)


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


#: What torch's ``PyTorchStreamWriter`` (``caffe2/serialize/inline_container.cc``) says of
#: a write that wrote less than asked, with no errno: on a full disk, one save in four.
_SHORT_WRITE = ("file write failed", "inline_container.cc")
#: A file system with less free than this (to this process) counts as full.
_NEARLY_FULL_BYTES = 1 << 20


def _cause_text(
    err: BaseException | object, logged: Sequence[str] = (), directory: str | Path | None = None
) -> str:
    """``err``'s first line, or "no space left on device" where it, its causes or the lines
    ``logged`` with it show a full disk (``directory``: where it was written)."""
    seen: set[int] = set()
    current: BaseException | None = err if isinstance(err, BaseException) else None
    texts = [*logged] if current is not None else [str(err), *logged]
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return "no space left on device"
        texts.append(str(current))
        current = current.__cause__ or current.__context__
    if any("No space left on device" in text for text in texts):
        return "no space left on device"
    short_write = any(mark in text for text in texts for mark in _SHORT_WRITE)
    if short_write and directory is not None and _is_full(directory):
        return "no space left on device"
    return _first_line(err)


def _is_full(directory: str | Path) -> bool:
    """Whether the file system of ``directory`` (or of its nearest existing parent) has
    (nearly) no space left for this process."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < _NEARLY_FULL_BYTES


def _first_line(err: BaseException | object) -> str:
    """``Type: first sentence`` of an exception's message, at most about 120 characters."""
    text = " ".join(str(err).split())
    sentence = text.split(". ", 1)[0].rstrip(". ")
    if len(sentence) > 120:
        sentence = sentence[:117] + "..."
    return f"{type(err).__name__}: {sentence}" if sentence else type(err).__name__
