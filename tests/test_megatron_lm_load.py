"""Megatron-LM's loop reads the checkpoint it will load without running code from it first
(:func:`megatron_dualpipe.megatron_lm.check_load`, called by ``apply`` on every rank and by
``train`` before any rank starts): the directory Megatron-LM's
``load_checkpoint`` picks (the tracked iteration, ``release`` or ``--ckpt-step``), each
crafted pickle refused with the marker it would make never made, a damaged or incomplete
checkpoint named with the complete ones to load instead, and a ``--load`` that Megatron-LM
would quietly train from scratch over (missing, a file) refused."""

from __future__ import annotations

import argparse
import os
import pickle
import re
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.compat.version import common_state_in_dcp
from megatron_dualpipe.megatron.schedule.checks import DualPipeConfigError
from megatron_dualpipe.megatron_lm import check_load
from tests.test_checkpoint_trust import OPEN, _checkpoint, _Creates

pytestmark = pytest.mark.megatron


def _args(root: Path | None, **given: object) -> argparse.Namespace:
    """Megatron-LM 0.19's load arguments, its defaults but ``load``."""
    defaults = {
        "load": None if root is None else str(root),
        "ckpt_format": "torch_dist",
        "ckpt_step": None,
        "pretrained_checkpoint": None,
        "auto_detect_ckpt_format": False,
        "non_persistent_ckpt_type": None,
    }
    return argparse.Namespace(**{**defaults, **given})


def _saved(root: Path, *iterations: int, tracked: str | None = None) -> Path:
    """``root`` holding torch_dist checkpoints of ``iterations`` and a tracker naming
    ``tracked`` (default: the last iteration)."""
    for i in iterations:
        _checkpoint(root / f"iter_{i:07d}")
    (root / "latest_checkpointed_iteration.txt").write_text(f"{tracked or iterations[-1]}\n")
    return root


def _crafted(directory: Path, marker: Path) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(_Creates(marker)))


def test_the_tracked_crafted_checkpoint_is_refused_naming_the_complete_ones(tmp_path: Path) -> None:
    root, marker = _saved(tmp_path / "ck", 2, 4), tmp_path / "ran"
    _crafted(root / "iter_0000004", marker)
    with pytest.raises(DualPipeConfigError) as info:
        check_load(_args(root))
    assert str(info.value) == (
        f"--load {root}: iter_0000004 cannot be loaded, .metadata refers to {OPEN}, which is "
        "not one of torch.distributed.checkpoint's metadata classes (nothing of it was run): "
        "pass --ckpt-step with a complete one (iterations 2)"
    )
    assert not marker.exists()
    check_load(_args(root, ckpt_step=2))  # the complete one reads


def test_ckpt_step_and_release_are_the_directories_read(tmp_path: Path) -> None:
    """As Megatron-LM's ``_load_base_checkpoint``: ``--ckpt-step`` over the tracker, but a
    ``release`` tracker keeps the release folder; the tracker read with ``int()``."""
    root, marker = _saved(tmp_path / "ck", 2, 4), tmp_path / "ran"
    _crafted(root / "iter_0000002", marker)
    check_load(_args(root))  # the tracked iteration 4 is fine
    with pytest.raises(DualPipeConfigError, match=r"iter_0000002 cannot be loaded, \.metadata"):
        check_load(_args(root, ckpt_step=2))
    (root / "latest_checkpointed_iteration.txt").write_text("+2\n")  # int() reads it
    with pytest.raises(DualPipeConfigError, match=r"iter_0000002 cannot be loaded"):
        check_load(_args(root))
    release = _checkpoint(root / "release")
    (root / "latest_checkpointed_iteration.txt").write_text("release\n")
    check_load(_args(root, ckpt_step=2))  # Megatron-LM loads release/, which is fine
    _crafted(release, marker)
    with pytest.raises(DualPipeConfigError, match=r": release cannot be loaded, \.metadata"):
        check_load(_args(root))
    assert not marker.exists()


def test_the_pretrained_checkpoint_is_read_where_load_tracks_none(tmp_path: Path) -> None:
    pretrained, marker = _saved(tmp_path / "pre", 7), tmp_path / "ran"
    _crafted(pretrained / "iter_0000007", marker)
    with pytest.raises(DualPipeConfigError) as info:
        check_load(_args(tmp_path / "fresh", pretrained_checkpoint=str(pretrained)))
    assert str(info.value).startswith(
        f"--pretrained-checkpoint {pretrained}: iter_0000007 cannot be loaded, .metadata "
    )
    check_load(_args(_saved(tmp_path / "ck", 2), pretrained_checkpoint=str(pretrained)))
    assert not marker.exists()


def test_nothing_is_read_where_megatron_lm_loads_no_torch_dist_checkpoint(
    tmp_path: Path,
) -> None:
    root, marker = _saved(tmp_path / "ck", 2), tmp_path / "ran"
    _crafted(root / "iter_0000002", marker)
    check_load(_args(root, ckpt_format="torch"))  # Megatron-LM's other format: not read
    with pytest.raises(DualPipeConfigError):  # ... unless it detects the format on disk
        check_load(_args(root, ckpt_format="torch", auto_detect_ckpt_format=True))
    check_load(_args(root, non_persistent_ckpt_type="global"))  # one may win: not read
    check_load(_args(None))
    (root / "latest_checkpointed_iteration.txt").write_text("junk\n")
    check_load(_args(root))  # Megatron-LM refuses the tracker itself
    (root / "latest_checkpointed_iteration.txt").unlink()
    check_load(_args(root))  # no tracker: Megatron-LM starts from scratch
    (root / "iter_0000002" / "metadata.json").unlink()  # not dist_checkpointing's format
    check_load(_args(root, ckpt_step=2))
    assert not marker.exists()


def test_a_damaged_one_without_a_complete_one_says_to_start_over(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", 3)
    (root / "iter_0000003" / ".metadata").unlink()
    with pytest.raises(DualPipeConfigError) as info:
        check_load(_args(root))
    assert str(info.value) == (
        f"--load {root}: iter_0000003 cannot be loaded, .metadata is missing: there is no "
        "complete checkpoint in it: drop --load to train from scratch"
    )


def _refused(root: Path, **given: object) -> str:
    with pytest.raises(DualPipeConfigError) as info:
        check_load(_args(root, **given))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_load_that_is_missing_or_a_file_is_refused(tmp_path: Path) -> None:
    """Megatron-LM trained from scratch over either and exited 0."""
    nowhere = tmp_path / "nowhere"
    assert _refused(nowhere) == (
        f"--load {nowhere} does not exist: point --load at the save folder of an earlier run, "
        "or drop it to train from scratch (a run that loads and saves one folder may start "
        "before it exists)"
    )
    check_load(_args(nowhere, save=str(nowhere)))  # a job's first run
    check_load(_args(nowhere, save=str(tmp_path / "x" / ".." / "nowhere")))  # the same folder
    check_load(_args(nowhere, non_persistent_ckpt_type="global"))  # Megatron-LM tries it first
    (tmp_path / "file").write_text("x")
    assert _refused(tmp_path / "file") == (
        f"--load {tmp_path / 'file'} is a file, not a checkpoint directory: point --load at the "
        "save folder of an earlier run, or drop it to train from scratch"
    )


def test_a_truncated_shard_names_the_complete_ones(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", 2, 3)
    shard = next((root / "iter_0000003").glob("*.distcp"))
    size = shard.stat().st_size
    os.truncate(shard, 10)
    assert _refused(root) == (
        f"--load {root}: iter_0000003 cannot be loaded, {shard.name} is truncated (10 of its "
        f"{size} bytes): pass --ckpt-step with a complete one (iterations 2)"
    )


#: The files of a checkpoint whose loss is found before loading (common.pt only where
#: megatron-core writes the common state there, before 0.19; without metadata.json the
#: folder is not dist_checkpointing's and Megatron-LM's own loader speaks).
SAVED_FILES = [".metadata", "shard"] + ([] if common_state_in_dcp() else ["common.pt"])


@pytest.mark.parametrize("name", SAVED_FILES)
def test_a_deleted_file_or_an_incomplete_save_is_named(tmp_path: Path, name: str) -> None:
    root = _saved(tmp_path / "ck", 2, 3)
    directory = root / "iter_0000003"
    lost = next(directory.glob("*.distcp")) if name == "shard" else directory / name
    lost.unlink()
    assert _refused(root) == (
        f"--load {root}: iter_0000003 cannot be loaded, {lost.name} is missing: pass "
        "--ckpt-step with a complete one (iterations 2)"
    )


def test_random_bytes_are_named_before_anything_is_loaded(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", 2, 3)
    for item in (root / "iter_0000003").iterdir():
        item.write_bytes(b"\xff" + os.urandom(item.stat().st_size))
    message = _refused(root)
    assert message.startswith(
        f"--load {root}: iter_0000003 cannot be loaded, metadata.json cannot be read "
        "(UnicodeDecodeError:"
    )
    assert message.endswith(": pass --ckpt-step with a complete one (iterations 2)")


def test_shards_with_random_objects_are_named_before_anything_is_loaded(tmp_path: Path) -> None:
    """The shards' objects other than tensors are read as the check reads them."""
    root = _saved(tmp_path / "ck", 2, 3)
    for shard in (root / "iter_0000003").glob("*.distcp"):
        shard.write_bytes(b"\xff" + os.urandom(shard.stat().st_size - 1))
    message = _refused(root)
    assert re.match(
        rf"--load {re.escape(str(root))}: iter_0000003 cannot be loaded, __\d_\d\.distcp "
        r"\(its object \S+\) cannot be read \(",
        message,
    ), message
