"""Megatron-LM's loop reads the checkpoint it will load without running code from it first
(:func:`megatron_dualpipe.megatron_lm.check_load`, called by ``apply`` on every rank and by
``train --loop megatron-lm`` before any rank starts): the directory Megatron-LM's
``load_checkpoint`` picks (the tracked iteration, ``release`` or ``--ckpt-step``), each
crafted pickle refused with the marker it would make never made."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.schedule.checks import DualPipeConfigError
from megatron_dualpipe.megatron_lm import check_load
from tests.test_checkpoint_trust import OPEN, _checkpoint, _Creates

pytestmark = pytest.mark.megatron


def _args(root: Path, **given: object) -> argparse.Namespace:
    return argparse.Namespace(
        **{"load": str(root), "ckpt_format": "torch_dist", "ckpt_step": None, **given}
    )


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
    root, marker = _saved(tmp_path / "ck", 2, 4), tmp_path / "ran"
    _crafted(root / "iter_0000002", marker)
    check_load(_args(root))  # the tracked iteration 4 is fine
    with pytest.raises(DualPipeConfigError, match=r"iter_0000002 cannot be loaded, \.metadata"):
        check_load(_args(root, ckpt_step=2))
    release = _checkpoint(root / "release")
    (root / "latest_checkpointed_iteration.txt").write_text("release\n")
    check_load(_args(root))
    _crafted(release, marker)
    with pytest.raises(DualPipeConfigError, match=r": release cannot be loaded, \.metadata"):
        check_load(_args(root))
    assert not marker.exists()


def test_nothing_is_read_without_a_tracked_torch_dist_checkpoint(tmp_path: Path) -> None:
    root, marker = _saved(tmp_path / "ck", 2), tmp_path / "ran"
    _crafted(root / "iter_0000002", marker)
    check_load(_args(root, ckpt_format="torch"))  # Megatron-LM's other format: not ours to read
    check_load(_args(root, load=None))
    (root / "latest_checkpointed_iteration.txt").unlink()
    check_load(_args(root))  # no tracker: Megatron-LM starts from scratch
    check_load(_args(tmp_path / "nowhere"))
    assert not marker.exists()


def test_a_damaged_one_without_a_complete_one_says_to_start_over(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", 3)
    (root / "iter_0000003" / "metadata.json").unlink()
    with pytest.raises(DualPipeConfigError) as info:
        check_load(_args(root))
    assert str(info.value) == (
        f"--load {root}: iter_0000003 cannot be loaded, metadata.json is missing: there is no "
        "complete checkpoint in it: drop --load to train from scratch"
    )
