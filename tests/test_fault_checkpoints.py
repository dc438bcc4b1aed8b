"""Bad checkpoint paths and damaged checkpoints get one sentence, before any work where the
files tell; a full disk during a save names the iteration and keeps the last complete
checkpoint; a resumed run's learning-rate schedule follows Megatron-LM's rules.

One run saves iterations 1-3 of the tiny config (module fixture); each test damages a copy.
Refusals found from the files alone come before any rank starts (well under a second);
the rest run the ranks and are bounded by the harness's timeouts.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.checkpoint.files import CheckpointError
from megatron_dualpipe.megatron.compat.version import common_state_in_dcp
from megatron_dualpipe.megatron.training import ConfigError, TrainError, load_config, train
from tests.processes import OUR_LOOP, wait_for

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc, pytest.mark.slow]

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"
SAVED = 3
LR = re.compile(r"^ \[[-\d :.]+\] iteration +(\d+)/ +\d+ \|.* learning rate: (\S+) \|")


def _cfg(*overrides: str):
    return load_config(TINY, ["eval_interval=null", "output_dir=null", *overrides])


def _run(*overrides: str):
    return train(_cfg(*overrides), source=str(TINY))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    result = _run(f"train_iters={SAVED}", f"save={root}", "save_interval=1")
    assert result.saved == [1, 2, 3]
    return root


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return root


def _refused(message: str, *overrides: str) -> None:
    with pytest.raises(CheckpointError) as info:
        _run(f"train_iters={SAVED}", *overrides)
    assert str(info.value) == message


# -- load: paths -------------------------------------------------------------------------


def test_a_load_path_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    _refused(
        f"load: {tmp_path / 'nope'} does not exist: point load at a checkpoint directory (the "
        "save directory of an earlier run), or unset it to train from scratch",
        f"load={tmp_path / 'nope'}",
    )


def test_a_missing_load_that_is_also_save_starts_from_scratch(tmp_path: Path) -> None:
    """A config's first submission (configs/deepseek_v3_pp16.yaml, dense_70b_dualpipe.yaml:
    load and save one folder that is not there yet) trains from scratch, as Megatron-LM
    does, says so in one line, and saves there."""
    root = tmp_path / "ckpt"
    result = _run(f"train_iters={SAVED}", f"save={root}", f"load={root}")
    assert [line for line in result.lines if "from scratch" in line] == [
        f" no checkpoint under {root}: training from scratch"
    ]
    assert result.resumed_from is None
    assert result.saved == [SAVED]


def test_a_load_path_that_is_a_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    _refused(f"load: {tmp_path / 'file'} is a file, not a checkpoint directory",
             f"load={tmp_path / 'file'}")  # fmt: skip


def test_checkpoints_without_a_tracker_are_not_ignored(copy: Path) -> None:
    (copy / "latest_checkpointed_iteration.txt").unlink()
    _refused(
        f"{copy} holds checkpoints but no latest_checkpointed_iteration.txt: load an earlier "
        f"iteration with ckpt_step (complete checkpoints in {copy}: iterations 1, 2, 3)",
        f"load={copy}",
    )


def test_a_tracker_that_is_not_a_number(copy: Path) -> None:
    (copy / "latest_checkpointed_iteration.txt").write_text("three\n")
    _refused(
        f"{copy / 'latest_checkpointed_iteration.txt'}: expected an iteration number, found "
        f"'three': load an earlier iteration with ckpt_step (complete checkpoints in {copy}: "
        "iterations 1, 2, 3)",
        f"load={copy}",
    )


def test_a_tracker_naming_a_missing_iteration(copy: Path) -> None:
    (copy / "latest_checkpointed_iteration.txt").write_text("9\n")
    _refused(
        f"latest_checkpointed_iteration.txt in {copy} names iteration 9, but "
        f"{copy / 'iter_0000009'} does not exist: load an earlier iteration with ckpt_step "
        f"(complete checkpoints in {copy}: iterations 1, 2, 3)",
        f"load={copy}",
    )


# -- load: damaged iteration directories ------------------------------------------------


def _advice(root: Path) -> str:
    listed = f"complete checkpoints in {root}: iterations 1, 2"
    return f"load an earlier iteration with ckpt_step ({listed})"


def test_a_truncated_shard(copy: Path) -> None:
    shard = copy / "iter_0000003" / "__1_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, 1000)
    _refused(
        f"checkpoint {copy / 'iter_0000003'}: __1_0.distcp is truncated (1000 of its {size} "
        f"bytes): {_advice(copy)}",
        f"load={copy}",
    )


#: The files a checkpoint holds besides its shards (common.pt only where megatron-core writes
#: the common state there, before 0.19).
SAVED_FILES = [".metadata", "metadata.json"] + ([] if common_state_in_dcp() else ["common.pt"])


@pytest.mark.parametrize("name", ["__1_0.distcp", *SAVED_FILES])
def test_a_deleted_file(copy: Path, name: str) -> None:
    (copy / "iter_0000003" / name).unlink()
    _refused(f"checkpoint {copy / 'iter_0000003'}: {name} is missing: {_advice(copy)}",
             f"load={copy}")  # fmt: skip


def test_an_incomplete_directory_named_by_the_tracker(copy: Path) -> None:
    """What a kill in the middle of a save leaves: some files, no metadata."""
    for item in (copy / "iter_0000003").iterdir():
        if item.name != "common.pt":
            item.unlink()
    _refused(f"checkpoint {copy / 'iter_0000003'}: metadata.json is missing: {_advice(copy)}",
             f"load={copy}")  # fmt: skip


def test_every_file_replaced_by_random_bytes(copy: Path) -> None:
    for item in (copy / "iter_0000003").iterdir():
        item.write_bytes(b"\xff" + os.urandom(item.stat().st_size))
    with pytest.raises(CheckpointError) as info:
        _run(f"train_iters={SAVED}", f"load={copy}")
    assert str(info.value).startswith(
        f"checkpoint {copy / 'iter_0000003'}: metadata.json cannot be read (UnicodeDecodeError:"
    )
    assert str(info.value).endswith(_advice(copy))


def test_shards_of_the_right_length_with_random_contents(copy: Path) -> None:
    """The shards' objects other than tensors are read before any rank starts."""
    for shard in (copy / "iter_0000003").glob("*.distcp"):
        shard.write_bytes(b"\xff" + os.urandom(shard.stat().st_size - 1))
    with pytest.raises(CheckpointError) as info:
        _run(f"train_iters={SAVED}", f"load={copy}")
    message = str(info.value)
    assert re.match(
        rf"checkpoint {re.escape(str(copy / 'iter_0000003'))}: __\d_\d\.distcp \(its object "
        r"\S+\) cannot be read \(",
        message,
    ), message
    assert message.endswith(_advice(copy)) and "\n" not in message


def _object_ranges(directory: Path) -> dict[str, list[tuple[int, int]]]:
    """Per shard file, the (offset, end) of each object that is not a tensor."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron_dualpipe.megatron.checkpoint.trust import read_metadata

    found = read_metadata(directory / ".metadata")
    ranges: dict[str, list[tuple[int, int]]] = {}
    for index, info in found.storage_data.items():
        if isinstance(found.state_dict_metadata[index.fqn], BytesStorageMetadata):
            span = (info.offset, info.offset + info.length)
            ranges.setdefault(info.relative_path, []).append(span)
    return ranges


@pytest.mark.slow
def test_shards_with_random_tensors(copy: Path) -> None:
    """Only reading the tensors finds this: after the ranks start, one sentence all the same."""
    directory = copy / "iter_0000003"
    kept = _object_ranges(directory)
    for shard in directory.glob("*.distcp"):
        data = bytearray(shard.read_bytes())
        noise = bytearray(os.urandom(len(data)))
        for start, end in kept.get(shard.name, []):
            noise[start:end] = data[start:end]
        shard.write_bytes(bytes(noise))
    with pytest.raises(TrainError) as info:
        _run(f"train_iters={SAVED}", f"load={copy}")
    message = str(info.value)
    # Every rank reads its own shards on megatron-core 0.16.1; from 0.19 rank 0 alone may.
    assert re.match(
        rf"checkpoint {re.escape(str(directory))} cannot be loaded: reading it failed on "
        r"(rank 0|ranks 0, 1) \(\w+",
        message,
    ), message
    assert message.endswith(_advice(copy)) and "\n" not in message


#: How a pickle names ``open``: ``io.open`` on Python 3.11, ``_io.open`` from 3.12.
OPEN = f"{open.__module__}.{open.__qualname__}"


class _Creates:
    """Pickles to a call of ``open(path, "w")``: unpickled the plain way, it makes ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (str(self.path), "w"))


def test_a_crafted_metadata_is_refused_before_any_rank_starts(copy: Path, tmp_path: Path) -> None:
    """torch's reader unpickles ``.metadata`` with ``pickle.load``; the check does not."""
    marker = tmp_path / "ran"
    (copy / "iter_0000003" / ".metadata").write_bytes(pickle.dumps(_Creates(marker)))
    _refused(
        f"checkpoint {copy / 'iter_0000003'}: .metadata refers to {OPEN}, which is not one of "
        f"torch.distributed.checkpoint's metadata classes (nothing of it was run): {_advice(copy)}",
        f"load={copy}",
    )
    assert not marker.exists()


def test_ckpt_step_loads_an_earlier_iteration(copy: Path) -> None:
    os.truncate(copy / "iter_0000003" / "__0_0.distcp", 10)
    result = _run(f"train_iters={SAVED}", f"load={copy}", "ckpt_step=2")
    assert result.resumed_from == 2 and sorted(result.losses) == [3]


def test_ckpt_step_needs_load() -> None:
    with pytest.raises(ConfigError, match=r"ckpt_step: needs load"):
        _cfg(f"train_iters={SAVED}", "ckpt_step=2")


# -- resuming: the learning-rate schedule -----------------------------------------------


def _lr_at(result, iteration: int) -> float:
    return {int(m[1]): float(m[2]) for m in map(LR.match, result.lines) if m}[iteration]


def test_a_longer_run_from_a_checkpoint_must_say_which_schedule_wins(copy: Path) -> None:
    _refused(
        f"{copy / 'iter_0000003'}: the checkpoint's learning-rate schedule differs from the "
        "config's (lr_decay_iters (default: train_iters): 3 in the checkpoint, 6 now): set "
        "override_opt_param_scheduler: true to follow the config's schedule from the "
        "checkpoint's iteration on, or use_checkpoint_opt_param_scheduler: true to keep the "
        "checkpoint's",
        f"load={copy}",
        "train_iters=6",
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "lr_at_4"),
    [
        # cosine from 3e-3 to 3e-4 over iterations 2-6: half way at iteration 4
        ("override_opt_param_scheduler", 1.65e-3),
        # the checkpoint's schedule ended at iteration 3: flat at min_lr
        ("use_checkpoint_opt_param_scheduler", 3.0e-4),
    ],
)
def test_the_chosen_schedule_is_the_one_followed(copy: Path, key: str, lr_at_4: float) -> None:
    result = _run(f"load={copy}", "train_iters=6", f"{key}=true")
    assert result.resumed_from == SAVED
    assert _lr_at(result, 4) == pytest.approx(lr_at_4)


def test_both_schedule_keys_at_once_is_an_error() -> None:
    with pytest.raises(
        ConfigError,
        match="override_opt_param_scheduler: and "
        "use_checkpoint_opt_param_scheduler are both set: choose one",
    ):
        _cfg(f"train_iters={SAVED}", "override_opt_param_scheduler=true",
             "use_checkpoint_opt_param_scheduler=true")  # fmt: skip


# -- save ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["proc", "file"])
def test_an_unwritable_save_is_refused_before_the_first_iteration(tmp_path: Path, where) -> None:
    if where == "proc":
        path, why = Path("/proc/megatron-dualpipe-test"), "No such file or directory"
    else:
        (tmp_path / "file").write_text("x")
        path, why = tmp_path / "file" / "ckpt", "Not a directory"
    with pytest.raises(TrainError) as info:
        _run(f"train_iters={SAVED}", f"save={path}")
    assert str(info.value) == (
        f"save: cannot write to {path} on ranks 0, 1 ({why}): set save to a directory every "
        "rank can write to"
    )


@contextlib.contextmanager
def _tmpfs(where: Path, options: str):
    """A tmpfs mounted at ``where`` for the block; the test is skipped where mounting is
    not allowed."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip("mounting a tmpfs needs privileges this machine does not grant")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """A read-only file system (a tmpfs mounted ro)."""
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as mount:
        yield mount


@pytest.mark.slow
def test_a_read_only_save_is_refused_before_the_first_iteration(read_only_dir: Path) -> None:
    with pytest.raises(TrainError) as info:
        _run(f"train_iters={SAVED}", f"save={read_only_dir / 'ckpt'}")
    assert str(info.value) == (
        f"save: cannot write to {read_only_dir / 'ckpt'} on ranks 0, 1 (Read-only file system): "
        "set save to a directory every rank can write to"
    )


def test_an_unwritable_output_dir_is_refused_before_the_first_iteration() -> None:
    path = Path("/proc/megatron-dualpipe-test")
    with pytest.raises(TrainError) as info:
        train(load_config(TINY, [f"train_iters={SAVED}", f"output_dir={path}"]), source=str(TINY))
    assert str(info.value) == (
        f"output_dir: cannot write to {path} on rank 0 (No such file or directory): set "
        "output_dir to a directory rank 0 can write to"
    )


@pytest.mark.slow
def test_a_full_disk_names_the_iteration_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    """Iteration 2's shard files are /dev/full: every write fails with ENOSPC."""
    root = tmp_path / "ckpt"
    (root / "iter_0000002").mkdir(parents=True)
    for rank in range(2):
        for part in range(2):
            (root / "iter_0000002" / f"__{rank}_{part}.distcp").symlink_to("/dev/full")
    with pytest.raises(TrainError) as info:
        _run(f"train_iters={SAVED}", f"save={root}", "save_interval=1")
    assert str(info.value) == (
        f"saving iteration 2 to {root / 'iter_0000002'} failed on ranks 0, 1: no space left on "
        "device; the last complete checkpoint is iteration 1 (the tracker still names it): free "
        f"space in {root} or set save to another directory"
    )
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    result = _run(f"train_iters={SAVED}", f"load={root}")  # and it loads
    assert result.resumed_from == 1 and sorted(result.losses) == [2, 3]


#: What a checkpoint writer worker raised on a full disk one save in four (torch's
#: PyTorchStreamWriter's short write, no errno), as megatron-core's writer wraps it.
_SHORT_WRITE = (
    "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
    "data/3: file write failed"
)


def _worker_failure() -> RuntimeError:
    try:
        raise RuntimeError(f"Worker failure: {_SHORT_WRITE}") from RuntimeError(_SHORT_WRITE)
    except RuntimeError as err:
        return err


def test_a_short_write_on_a_full_disk_says_the_disk_is_full(tmp_path: Path) -> None:
    """It was reported as ``Worker failure [enforce fail at inline_container.cc:672]`` with
    the advice to choose a directory every rank can write to."""
    from megatron_dualpipe.megatron.checkpoint.files import failure_cause
    from megatron_dualpipe.megatron.training.checkpoint.save_load import _save_failure

    err = _worker_failure()
    with _tmpfs(tmp_path / "disk", "size=4m") as disk:
        root = disk / "ckpt"
        root.mkdir()
        assert failure_cause(err, (), root) == (
            [], "RuntimeError: Worker failure: [enforce fail at inline_container.cc:672]"
        )  # room left: the worker's words
        with pytest.raises(OSError), (disk / "filler").open("wb") as filler:
            filler.write(b"x" * (8 << 20))
        assert failure_cause(err, (), root) == ([], "no space left on device")
        assert _save_failure(str(root), 2, err) == (
            f"saving iteration 2 to {root / 'iter_0000002'} failed: no space left on device; "
            f"there is no complete checkpoint in {root} yet: free space in {root} or set save "
            "to another directory"
        )


def test_another_seq_length_is_refused_before_any_rank_starts(copy: Path) -> None:
    """The learned position table follows seq_length where max_position_embeddings is left
    unset: it was found only after the ranks started, with the advice to load an earlier
    iteration (all of them have the same table)."""
    _refused(
        f"{copy / 'iter_0000003'}: the checkpoint's learned position embeddings cover 16 "
        "positions but the config's cover 32 (seq_length 32; max_position_embeddings defaults "
        "to seq_length): a checkpoint only loads into the same model: set "
        "max_position_embeddings: 16 with seq_length at most 16, or train from scratch",
        f"load={copy}",
        "seq_length=32",
    )


@pytest.mark.slow
def test_a_save_directory_turned_read_only_mid_run_is_one_sentence(tmp_path: Path) -> None:
    """A tmpfs remounted read-only after the first save (it was a 22-line traceback of
    rank 0's mkdir while rank 1 waited); skipped where mounting is not allowed."""
    with _tmpfs(tmp_path / "fs", "size=64m") as mount:
        save = mount / "ckpt"
        sets = [f"save={save}", "save_interval=3", "train_iters=300", "output_dir=null",
                "eval_interval=null"]  # fmt: skip
        command = [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(TINY)]
        command += OUR_LOOP
        err = tmp_path / "stderr"
        proc = subprocess.Popen(
            [*command, *[arg for item in sets for arg in ("--set", item)]],
            stdout=subprocess.DEVNULL,
            stderr=err.open("w"),
        )
        try:
            tracker = save / "latest_checkpointed_iteration.txt"
            wait_for("the first save", tracker.exists, proc)
            subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
            assert proc.wait(timeout=120) == 2
        finally:
            proc.kill()
            proc.wait()
    lines = err.read_text().splitlines()
    assert re.fullmatch(
        rf"megatron-dualpipe: error: saving iteration 6 to {re.escape(str(save))}/iter_0000006 "
        r"failed on rank 0: Read-only file system \(\S+\); the last complete checkpoint is "
        r"iteration 3 \(the tracker still names it\): set save to a directory every rank can "
        r"write to",
        lines[-1],
    ), lines[-1]
    assert not any("Traceback" in line for line in lines), lines


# -- save: another run's checkpoints -----------------------------------------------------


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".megatron-dualpipe")
    }


def test_a_fresh_run_into_another_runs_checkpoints_is_refused(copy: Path) -> None:
    """It trained and overwrote iterations 1-3 of the other run, leaving the folder mixed."""
    before = _files(copy)
    _refused(
        f"save: {copy} holds complete checkpoints of another run (iterations 1, 2, 3) and this "
        f"run does not load from it, so its saves would overwrite them: resume that run with "
        f"load: {copy} (load and save one folder), or choose another save",
        f"save={copy}",
        "save_interval=1",
    )
    assert _files(copy) == before


def test_a_run_loading_elsewhere_into_another_runs_checkpoints_is_refused(
    saved: Path, copy: Path
) -> None:
    _refused(
        f"save: {copy} holds complete checkpoints of another run (iterations 1, 2, 3) and this "
        f"run loads from {saved}, so its saves would overwrite them: resume that run with "
        f"load: {copy} (load and save one folder), or choose another save",
        f"save={copy}",
        f"load={saved}",
    )


def test_an_incomplete_checkpoint_is_overwritten_as_megatron_lm_does(copy: Path) -> None:
    """What a killed save leaves (no metadata.json, no tracker) is no run's checkpoint."""
    for iteration in (1, 2):
        shutil.rmtree(copy / f"iter_000000{iteration}")
    (copy / "iter_0000003" / "metadata.json").unlink()
    (copy / "latest_checkpointed_iteration.txt").unlink()
    result = _run(f"train_iters={SAVED}", f"save={copy}", "save_interval=1")
    assert result.saved == [1, 2, 3]
    assert (copy / "latest_checkpointed_iteration.txt").read_text() == "3\n"
