"""No code runs from a checkpoint: every pickle the pre-load check reads goes through an
allow-list (torch.distributed.checkpoint's metadata classes for ``.metadata``, torch's
weights-only loader for ``common.pt`` and the shards' objects), and a crafted one is
refused in one clause naming what it refers to, before anything of it runs.

Each crafted pickle would create a marker file when unpickled the plain way (``pickle.load``,
as torch's ``FileSystemReader.read_metadata`` does); the tests assert the refusal and that
the marker was never made. The checkpoints are torch.distributed.checkpoint's own, written
in this process, laid out as dist_checkpointing's ``torch_dist`` format.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, metadata, planner

from megatron_dualpipe.megatron.checkpoint.files import contents, damage
from megatron_dualpipe.megatron.checkpoint.trust import (
    ALLOWED,
    UntrustedPickle,
    read_metadata,
)

pytestmark = pytest.mark.megatron


#: How a pickle names ``open``: ``io.open`` on Python 3.11, ``_io.open`` from 3.12.
OPEN = f"{open.__module__}.{open.__qualname__}"


class _Creates:
    """Pickles to a call of ``open(path, "w")``: unpickled the plain way, it makes ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (str(self.path), "w"))


def _checkpoint(directory: Path, objects: dict | None = None) -> Path:
    """A ``torch_dist`` checkpoint directory: a tensor, the ``objects`` (non-tensor state,
    as the RNG states are) and a common state."""
    state = {"weight": torch.arange(6.0).view(2, 3), "rng": {"seed": 7}, **(objects or {})}
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({"iteration": 3, "model_config": {}}, directory / "common.pt")
    return directory


def test_a_checkpoint_written_by_torch_reads(tmp_path: Path) -> None:
    found = contents(_checkpoint(tmp_path / "ck"))
    assert found.common["iteration"] == 3
    assert set(found.metadata.state_dict_metadata) == {"weight", "rng.seed"}


def test_a_crafted_metadata_is_refused_without_running_it(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path / "ck")
    marker = tmp_path / "ran"
    (directory / ".metadata").write_bytes(pickle.dumps(_Creates(marker)))
    assert damage(directory) == (
        f".metadata refers to {OPEN}, which is not one of torch.distributed.checkpoint's "
        "metadata classes (nothing of it was run)"
    )
    assert not marker.exists()
    pickle.loads((directory / ".metadata").read_bytes())  # the plain way runs it
    assert marker.exists()


def test_a_crafted_common_state_is_refused_without_running_it(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path / "ck")
    marker = tmp_path / "ran"
    torch.save({"model_config": _Creates(marker)}, directory / "common.pt")
    assert damage(directory) == (
        f"common.pt refers to {OPEN}, which weights-only loading does not admit (nothing of "
        "it was run)"
    )
    assert not marker.exists()


def test_a_crafted_object_in_a_shard_is_refused_without_running_it(tmp_path: Path) -> None:
    """torch's loader reads a shard's objects with ``weights_only=False``: the check reads
    them first."""
    marker = tmp_path / "ran"
    directory = _checkpoint(tmp_path / "ck", {"extra": _Creates(marker)})
    assert damage(directory) == (
        f"__0_0.distcp (its object extra) refers to {OPEN}, which weights-only loading does "
        "not admit (nothing of it was run)"
    )
    assert not marker.exists()


def test_the_rerun_state_megatron_lm_saves_after_a_nan_reads(tmp_path: Path) -> None:
    """After a NaN, Megatron-LM's rerun state machine saves the calls that saw it (its
    ``Call`` and ``Caller`` records) for the resumed run: a checkpoint to resume from."""
    from megatron.core.rerun_state_machine import Call, Caller, RerunState

    state = {"state": RerunState.WILL_RERUN_FROM_CHECKPOINT, "calls": [Call(Caller("NaN", 1), 0)]}
    directory = _checkpoint(tmp_path / "ck", {"rerun_state_machine_state": state})
    assert damage(directory) is None


def test_a_pickle_of_something_else_is_refused(tmp_path: Path) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(UntrustedPickle, match="^holds a dict, not a checkpoint's Metadata$"):
        read_metadata(path)


def _record_classes(module) -> set[str]:
    """The dataclasses and enums ``module`` defines."""
    return {
        name
        for name, value in vars(module).items()
        if inspect.isclass(value)
        and value.__module__ == module.__name__
        and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
    }


def test_the_allow_list_is_torchs_metadata_records() -> None:
    """Every record class of torch's metadata and plan modules is admitted (a new one in a
    later torch shows here), and ``filesystem``'s storage records, nothing else of it."""
    assert ALLOWED[metadata.__name__] == _record_classes(metadata)
    assert ALLOWED[planner.__name__] == _record_classes(planner)
    assert ALLOWED[filesystem.__name__] == {"_StorageInfo", "_StoragePrefix"}
    assert ALLOWED[filesystem.__name__] <= _record_classes(filesystem)


# -- storage records that point outside the checkpoint -------------------------------------


def _repointed(directory: Path, relative_path: str) -> None:
    """Rewrite ``directory``'s ``.metadata``, torch's own classes only, with every storage
    record of the tensor ``weight`` naming ``relative_path``."""
    found = read_metadata(directory / ".metadata")
    found.storage_data = {
        index: dataclasses.replace(info, relative_path=relative_path)
        if index.fqn == "weight"
        else info
        for index, info in found.storage_data.items()
    }
    with (directory / ".metadata").open("wb") as stream:
        pickle.dump(found, stream)


@pytest.mark.parametrize("where", ["..", "absolute", "a symlink out", "a symlinked folder out"])
def test_a_storage_record_outside_the_checkpoint_is_refused(tmp_path: Path, where: str) -> None:
    """A crafted ``.metadata`` whose records point at another file (here a genuine shard of
    another checkpoint) passed the check and torch's reader loaded that file's bytes into
    the weights; now nothing is read from it."""
    directory = _checkpoint(tmp_path / "run" / "ck")
    outside = _checkpoint(tmp_path / "other") / "__0_0.distcp"
    if where == "..":
        name = "../../other/__0_0.distcp"
    elif where == "absolute":
        name = str(outside)
    elif where == "a symlink out":
        (directory / "link.distcp").symlink_to(outside)
        name = "link.distcp"
    else:
        (directory / "sub").symlink_to(outside.parent, target_is_directory=True)
        name = "sub/__0_0.distcp"
    _repointed(directory, name)
    assert damage(directory) == (
        f".metadata names the storage file {name!r}, which is not inside the checkpoint "
        "directory (nothing was read from it)"
    )


def test_a_symlink_that_stays_inside_the_checkpoint_reads(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path / "ck")
    (directory / "alias.distcp").symlink_to("__0_0.distcp")
    _repointed(directory, "alias.distcp")
    assert damage(directory) is None
