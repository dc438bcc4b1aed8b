"""Read what a checkpoint pickles without running code from it.

A ``torch_dist`` checkpoint holds three kinds of pickles, each of which would run a crafted
file's code under plain ``pickle``: :func:`read_metadata` reads ``.metadata`` with an
unpickler that admits only the classes torch and Megatron-Core write there, and
:func:`load_weights_only` reads ``common.pt`` and the shards' non-tensor objects with
``torch.load(weights_only=True)`` (numpy's array pieces and the rerun state machine's
records allowed). Anything else is refused with :class:`UntrustedPickle`, whose message
names what the file refers to. What each admits: docs/reliability.md, "What is safe to
load".
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.distributed.checkpoint import filesystem, metadata, planner

__all__ = ["ALLOWED", "UntrustedPickle", "load_weights_only", "read_metadata"]

#: What ``.metadata`` may refer to, by module: exactly these names.
ALLOWED: dict[str, frozenset[str]] = {
    metadata.__name__: frozenset(
        {
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    filesystem.__name__: frozenset({"_StorageInfo", "_StoragePrefix"}),
    planner.__name__: frozenset(
        {
            "BytesIOWriteData",
            "LoadItemType",
            "LoadPlan",
            "ReadItem",
            "SavePlan",
            "TensorWriteData",
            "WriteItem",
            "WriteItemType",
        }
    ),
    "torch": frozenset(
        {"Size"} | {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    ),
    "torch.serialization": frozenset({"_get_layout"}),
    # StorageMeta.checkpoint_id: torch's own FileSystemWriter records the path it was given.
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
}
_MODULES = {"torch": torch, "torch.serialization": torch.serialization, "pathlib": pathlib}
_MODULES.update({m.__name__: m for m in (metadata, filesystem, planner)})

#: numpy's pieces of an array, which the RNG states hold (numpy's generator state), under
#: both spellings of the module of ``_reconstruct`` (numpy 2's and numpy 1's).
_RECONSTRUCT = (np._core if hasattr(np, "_core") else np.core).multiarray._reconstruct
_NUMPY_ARRAY: list[Any] = [
    np.ndarray,
    np.dtype,
    *(getattr(np.dtypes, name) for name in np.dtypes.__all__ if name.endswith("DType")),
    (_RECONSTRUCT, "numpy._core.multiarray._reconstruct"),
    (_RECONSTRUCT, "numpy.core.multiarray._reconstruct"),
]


class UntrustedPickle(pickle.UnpicklingError):
    """A pickle that refers to something outside the allow-list; nothing of it was run."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose every global comes from :data:`ALLOWED`."""

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return getattr(_MODULES[module], name)
        raise UntrustedPickle(
            f"refers to {module}.{name}, which is not one of torch.distributed.checkpoint's "
            "metadata classes"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedPickle(f"refers to a persistent object ({str(pid)[:40]!r})")


def read_metadata(path: Path) -> metadata.Metadata:
    """The :class:`~torch.distributed.checkpoint.metadata.Metadata` pickled in ``path``;
    :class:`UntrustedPickle` when it refers to anything else (nothing of it runs)."""
    with path.open("rb") as stream:
        found = _MetadataUnpickler(stream).load()
    if not isinstance(found, metadata.Metadata):
        raise UntrustedPickle(f"holds a {type(found).__name__}, not a checkpoint's Metadata")
    return found


def load_weights_only(source: Path | BinaryIO) -> Any:
    """``torch.load(source, weights_only=True)`` on the CPU, with numpy arrays allowed;
    :class:`UntrustedPickle` naming what else the file refers to, a plain
    ``pickle.UnpicklingError`` with the weights-only loader's reason for damaged bytes."""
    if isinstance(source, Path):
        source = io.BytesIO(source.read_bytes())
    with torch.serialization.safe_globals([*_NUMPY_ARRAY, *_rerun_records()]):
        try:
            return torch.load(source, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise _refusal(err) from None


def _rerun_records() -> list[Any]:
    """The classes Megatron-Core's rerun state machine pickles into its state: its enums
    and the named tuples recording the calls that found an unexpected result."""
    from megatron.core import rerun_state_machine as rerun

    names = ("Call", "Caller", "RerunDiagnostic", "RerunMode", "RerunState")
    return [getattr(rerun, name) for name in names if hasattr(rerun, name)]


#: How torch's weights-only unpickler words a refusal of what a pickle refers to.
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
_REFUSED_OTHER = re.compile(
    r"(but got <class '[^']+'>|unrecognized function \S+|Unsupported class \S+)"
)


def _refusal(err: pickle.UnpicklingError) -> pickle.UnpicklingError:
    """The weights-only loader's error as :class:`UntrustedPickle` (what the pickle refers
    to) or, for bytes that are no pickle it could read, a plain error with its reason."""
    text = str(err)
    detail = text.split("WeightsUnpickler error:", 1)[-1].strip().split("\n")[0].strip()
    found = _REFUSED_GLOBAL.search(text)
    if found:
        return UntrustedPickle(
            f"refers to {found.group(1)}, which weights-only loading does not admit"
        )
    found = _REFUSED_OTHER.search(text)
    if found:
        return UntrustedPickle(f"holds what weights-only loading does not admit ({found.group(1)})")
    return pickle.UnpicklingError(detail or "not a pickle torch can read")
