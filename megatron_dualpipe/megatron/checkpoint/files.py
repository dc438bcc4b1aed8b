"""What a checkpoint directory holds on disk, read without any process group.

Whether an iteration directory of Megatron-LM's layout (dist_checkpointing's ``torch_dist``
format) is complete: its ``metadata.json``, common state and ``.metadata`` read, every shard
the index names is there at its full length and inside the directory, and the shards'
objects other than tensors load, all without running code from the files (:mod:`.trust`).
Every problem is one :class:`CheckpointError` sentence naming the directory, the file, what
is wrong and what to do (``ckpt_step`` with a complete iteration). Why and what is left to
Megatron-LM: docs/reliability.md, "Checkpoints".
"""

from __future__ import annotations

import io
import json
import re
from collections import defaultdict
from collections.abc import Callable
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
    "iteration_dir",
    "iterations",
    "missing_load",
]

TRACKER = "latest_checkpointed_iteration.txt"
COMMON_PT = "common.pt"
_ITERATION = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(DualPipeError, RuntimeError):
    """A checkpoint that cannot be saved or loaded into this run; the message says why."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"



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


def _same_folder(one: str | Path | None, other: Path) -> bool:
    """Whether ``one`` (None: no folder) names the folder ``other`` names, links resolved."""
    return one is not None and Path(one).resolve() == other.resolve()


def missing_load(
    load: str | None,
    *,
    save: str | None = None,
    pretrained: str | None = None,
    non_persistent: bool = False,
) -> str | None:
    """The sentence refusing ``--load`` on disk where it is a file, or does not exist and is
    not ``--save`` too (a job's first run may save where later runs load), where Megatron-LM
    would quietly train from scratch; None otherwise (no ``--load``, object storage, a
    ``--pretrained-checkpoint`` to fall back on, or non-persistent checkpoints, which
    Megatron-LM's ``_load_base_checkpoint`` tries first)."""
    from megatron.core.datasets.object_storage_utils import is_object_storage_path

    if not load or pretrained or non_persistent or is_object_storage_path(str(load)):
        return None
    path = Path(load)
    if path.is_file():
        return (
            f"--load {load} is a file, not a checkpoint directory: point --load at the save "
            "folder of an earlier run, or drop it to train from scratch"
        )
    if not path.exists() and not _same_folder(save, path):
        return (
            f"--load {load} does not exist: point --load at the save folder of an earlier "
            "run, or drop it to train from scratch (a run that loads and saves one folder may "
            "start before it exists)"
        )
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
    if _same_folder(load, root):
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


def _first_line(err: BaseException | object) -> str:
    """``Type: first sentence`` of an exception's message, at most about 120 characters."""
    text = " ".join(str(err).split())
    sentence = text.split(". ", 1)[0].rstrip(". ")
    if len(sentence) > 120:
        sentence = sentence[:117] + "..."
    return f"{type(err).__name__}: {sentence}" if sentence else type(err).__name__
