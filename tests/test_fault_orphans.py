"""Nothing of a run outlives its launcher, whatever kills the launcher.

The ranks' own children are the hard part: dist_checkpointing's writers (forked by a rank
while it saves), the result-queue manager it keeps for later saves (a spawned interpreter)
and multiprocessing's resource tracker (spawned too). Each test tags the run with an
environment variable that every process of it inherits, kills the launcher for real
(``kill -9``, or SIGHUP to its process group as a closing terminal sends it) and then
reads the whole process table: no process carrying the tag may be running five seconds
later.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.processes import as_from_a_terminal, wait_for

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_gpt_cpu.yaml"
TAG = "MEGATRON_DUALPIPE_TEST_RUN"
#: Every process of the run must be gone this soon after the launcher.
GONE_WITHIN_S = 5.0


def _tagged(tag: str) -> list[psutil.Process]:
    """Every running process (zombies aside) whose environment carries ``tag``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(TAG) == tag:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _survivors(tag: str, within_s: float = GONE_WITHIN_S) -> list[str]:
    """The tagged processes still running after ``within_s`` (at once when none is)."""
    deadline = time.monotonic() + within_s
    while True:
        left = _tagged(tag)
        if not left or time.monotonic() > deadline:
            out = []
            for proc in left:
                try:
                    out.append(f"{proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())}")
                except psutil.Error:
                    continue
            return out
        time.sleep(0.05)


@contextlib.contextmanager
def _started(
    args: list[str], tag: str, tmp_path: Path, nohup: bool = False, temp: Path | None = None
) -> Iterator[subprocess.Popen]:
    """``args`` under Python in a session of its own (so a signal to its process group
    reaches it and what it started, never pytest), tagged with ``tag``, its signals as a
    terminal gives them (``nohup``: SIGHUP ignored, as ``nohup`` starts it), with ``temp``
    as its temporary folder where given; on the way out whatever of it is left is killed."""
    env = dict(os.environ, **{TAG: tag}, **({"TMPDIR": str(temp)} if temp else {}))
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdout=(tmp_path / "stdout").open("w"),
        stderr=(tmp_path / "stderr").open("w"),
        start_new_session=True,
        preexec_fn=_under_nohup if nohup else as_from_a_terminal,
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
        for left in _tagged(tag):
            left.kill()


def _under_nohup() -> None:
    as_from_a_terminal()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _kinds(tag: str) -> set[str]:
    """What the tagged processes are: spawned interpreters ("spawn"), resource trackers
    ("tracker"), the rest by their command line's first argument."""
    kinds = set()
    for proc in _tagged(tag):
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" in line:
            kinds.add("tracker")
        elif "spawn_main" in line:
            kinds.add("spawn")
    return kinds


def _kill(proc: subprocess.Popen, how: str) -> None:
    if how == "kill -9":
        proc.kill()
    else:  # a closing terminal: SIGHUP to the foreground process group
        os.killpg(proc.pid, signal.SIGHUP)


#: A launcher whose two ranks each keep what dist_checkpointing's writer keeps: a manager
#: (a spawned interpreter, with the resource tracker it starts) and a forked child, then
#: wait in a collective until they are killed.
_RANKS_WITH_CHILDREN = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    import torch, torch.distributed as dist
    from megatron_dualpipe.runtime.launch import run_ranks

    def rank_main(rank, world_size, ready):
        queue = multiprocessing.get_context("spawn").Manager().Queue()
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        queue.put(rank)
        open(f"{ready}.{rank}", "w").close()
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
        time.sleep(600)

    run_ranks(rank_main, 2, args=(sys.argv[1],), timeout_s=600, pg_timeout_s=600)
    """
)


@pytest.mark.parametrize("how", ["kill -9", "SIGHUP"])
@pytest.mark.slow
def test_nothing_of_run_ranks_survives_its_launcher(tmp_path: Path, how: str) -> None:
    tag = uuid.uuid4().hex
    ready = tmp_path / "ready"
    with _started(["-c", _RANKS_WITH_CHILDREN, str(ready)], tag, tmp_path) as proc:
        wait_for(
            "both ranks' children",
            lambda: (
                all(Path(f"{ready}.{r}").exists() for r in range(2))
                and {"spawn", "tracker"} <= _kinds(tag)
            ),
            proc,
        )
        _kill(proc, how)
        assert _survivors(tag) == []


#: A launcher whose two ranks each fork a child as dist_checkpointing forks a writer (no
#: call of ours in the child), then wait until they are killed.
_RANKS_WITH_FORKS = textwrap.dedent(
    """
    import os, sys, time
    from megatron_dualpipe.runtime.launch import run_ranks

    def rank_main(rank, world_size, ready):
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        open(f"{ready}.{rank}", "w").close()
        time.sleep(600)

    run_ranks(rank_main, 2, args=(sys.argv[1],), timeout_s=600, pg_timeout_s=600)
    """
)


@pytest.mark.slow
def test_a_rank_s_forked_child_dies_with_it_when_everything_else_is_killed(
    tmp_path: Path,
) -> None:
    """``pkill -9 -f`` as it hit CI once: the launcher, its guard and the ranks killed
    together while a rank's forked child (a checkpoint writer) runs. Nobody is left to kill
    the child's process group; it must die with its rank (it ran on under PID 1)."""
    tag, ready = uuid.uuid4().hex, tmp_path / "ready"
    with _started(["-c", _RANKS_WITH_FORKS, str(ready)], tag, tmp_path) as proc:
        wait_for(
            "both ranks' forked children",
            lambda: all(Path(f"{ready}.{r}").exists() for r in range(2)),
            proc,
        )
        tagged = _tagged(tag)
        launched = {p.pid for p in tagged if _safely(p.ppid) == proc.pid}  # guard, ranks
        children = [p for p in tagged if _safely(p.ppid) in launched]
        assert len(launched) == 3 and len(children) == 2, [_safely(p.name) for p in tagged]
        # Launcher last: killed first, it would orphan the guard's process group, and the
        # kernel would wake the stopped guard to kill the group (children too) on its own.
        victims = sorted((p for p in tagged if p not in children), key=lambda p: p.pid == proc.pid)
        for action in (psutil.Process.suspend, psutil.Process.kill):
            for victim in victims:
                action(victim)
        assert _survivors(tag) == []


def _train(
    tmp_path: Path, tag: str, *sets: str, nohup: bool = False, temp: Path | None = None
) -> contextlib.AbstractContextManager:
    items = ("log_interval=1", *sets)
    args = [arg for item in items for arg in ("--set", item)]
    command = ["-m", "megatron_dualpipe", "train", "--config", str(TINY), *args]
    return _started(command, tag, tmp_path, nohup, temp)


def _writers(tag: str) -> list[psutil.Process]:
    """The forked checkpoint writers: tagged children of a rank with the rank's command line."""
    found = []
    for proc in _tagged(tag):
        try:
            parent = proc.parent()
            if parent is not None and proc.cmdline() == parent.cmdline():
                grand = parent.parent()
                if grand is not None and grand.cmdline() == parent.cmdline():
                    found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("when", ["while it writes", "after a save"])
@pytest.mark.megatron
@pytest.mark.route
def test_kill_9_of_train_leaves_no_writer(tmp_path: Path, when: str) -> None:
    """The issue's reproduction: ``kill -9`` of the launcher while a checkpoint is written,
    or mid-step with the writer pool of an earlier save still alive."""
    tag, save = uuid.uuid4().hex, tmp_path / "ck"
    interval = "1" if when == "while it writes" else "5"
    sets = (f"save={save}", f"save_interval={interval}", "train_iters=300")
    with _train(tmp_path, tag, *sets) as proc:
        if when == "while it writes":
            wait_for("a checkpoint writer", lambda: _writers(tag), proc)
        else:
            out = tmp_path / "stdout"
            wait_for(
                "iteration 7 after a save",
                lambda: " iteration        7/" in out.read_text() and "tracker" in _kinds(tag),
                proc,
            )
        proc.kill()
        assert _survivors(tag) == []


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.route
def test_sighup_stops_train_like_sigterm(tmp_path: Path) -> None:
    """A closing terminal (SIGHUP to the process group): one line, exit 129 (128 + 1), and
    every process of the run gone, the writer pool of the first save included."""
    tag, save = uuid.uuid4().hex, tmp_path / "ck"
    with _train(tmp_path, tag, f"save={save}", "save_interval=2", "train_iters=300") as proc:
        out = tmp_path / "stdout"
        wait_for(
            "iteration 3 after a save",
            lambda: " iteration        3/" in out.read_text() and "tracker" in _kinds(tag),
            proc,
        )
        _kill(proc, "SIGHUP")
        # the launcher stops its ranks in order first (longer on a loaded machine), then
        # nothing of the run may outlive it
        assert proc.wait(timeout=60) == 129
        assert _survivors(tag) == []
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert lines[-1] == "megatron-dualpipe: train terminated (SIGHUP)", lines[-5:]
    assert not any("Traceback" in line for line in lines), lines


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.route
def test_train_under_nohup_trains_on_after_sighup(tmp_path: Path) -> None:
    """``nohup megatron-dualpipe train ...``: a closing terminal's SIGHUP changes nothing
    (train used to put its own handler over nohup's and stop with exit 129)."""
    tag = uuid.uuid4().hex
    with _train(tmp_path, tag, "train_iters=6", nohup=True) as proc:
        out = tmp_path / "stdout"
        wait_for("iteration 1", lambda: " iteration        1/" in out.read_text(), proc)
        _kill(proc, "SIGHUP")
        assert proc.wait(timeout=240) == 0
    assert " iteration        6/       6 |" in out.read_text()


def _manager_directory(rank: int, world_size: int) -> str:
    """Start what dist_checkpointing's first save starts (a spawned manager) and return the
    ``pymp-*`` directory its socket lives in; the rank then ends as every rank does, by
    ``os._exit``, so no finaliser of multiprocessing removes it."""
    import multiprocessing

    manager = multiprocessing.get_context("spawn").Manager()
    _KEPT.append(manager)  # as dist_checkpointing keeps its queue: alive until the exit
    return os.path.dirname(manager.address)


#: What a forked rank keeps alive until it exits (in that process only).
_KEPT: list = []


def test_a_run_leaves_no_multiprocessing_directory_behind() -> None:
    from megatron_dualpipe.runtime.launch import run_ranks

    directories = run_ranks(_manager_directory, 2, timeout_s=120)
    assert all(Path(d).name.startswith("pymp-") for d in directories), directories
    assert [d for d in directories if os.path.exists(d)] == []


def _kill_the_guard(rank: int, world_size: int) -> int:
    """Rank 0 kills the run's guard (its process group's leader); both ranks then wait far
    longer than the test allows."""
    if rank == 0:
        os.kill(os.getpgid(0), signal.SIGKILL)
    time.sleep(120)
    return rank


def test_a_dead_guard_fails_the_launch_naming_it() -> None:
    """A guard killed alone used to go unnoticed (the run went on and exited 0, and a later
    ``kill -9`` of the launcher left every rank behind): now the launch fails at once."""
    from megatron_dualpipe.runtime.launch import GUARD_NAME, LaunchFailure, run_ranks

    started = time.monotonic()
    with pytest.raises(LaunchFailure) as info:
        run_ranks(_kill_the_guard, 2, timeout_s=60, pg_timeout_s=60)
    assert time.monotonic() - started < 30
    failure = info.value
    assert failure.guard is not None and failure.first == failure.guard == str(failure)
    assert f"the run's guard process ({GUARD_NAME}, pid " in failure.first
    assert ") was killed by SIGKILL, signal 9 while the ranks ran; " in failure.first
    assert failure.unfinished == [0, 1]


def _safely(read: Callable[[], Any]) -> Any:
    """``read()`` of a process, or None when the process is gone (or not readable)."""
    try:
        return read()
    except psutil.Error:
        return None


def _run_directories(launcher: int, temp: Path) -> list[Path]:
    """The run's temporary directories (the ranks', and the patched megatron/training
    ``train`` runs): named after the launcher's pid, in the folder ``temp``."""
    found = sorted(temp.glob(f"megatron-dualpipe-run-{launcher}-*"))
    assert found, list(temp.iterdir())
    return found


@pytest.fixture
def own_temp() -> Iterator[Path]:
    """A temporary folder of the test's own, short (the run's sockets live under it, and a
    Unix socket's path holds at most 107 bytes), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="mdp-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.route
def test_kill_9_of_the_whole_run_at_once_leaves_nothing(
    tmp_path: Path, own_temp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's reproduction of ``pkill -9 -f``: the launcher, its guard and the ranks
    killed together after a save (so each rank holds its writer's queue manager and the
    resource tracker). Nothing of the run may be left running five seconds later (they
    used to run on under PID 1), and the next launch removes the temporary directory
    nobody was left to remove. The run and that next launch share a temporary folder of
    their own: any other launch on the machine (CI's other leg) would sweep it as well."""
    from megatron_dualpipe.runtime.launch import run_ranks

    tag, save, temp = uuid.uuid4().hex, tmp_path / "ck", own_temp
    sets = (f"save={save}", "save_interval=2", "train_iters=300")
    with _train(tmp_path, tag, *sets, temp=temp) as proc:
        out = tmp_path / "stdout"
        wait_for(
            "iteration 3 after a save",
            lambda: (
                " iteration        3/" in out.read_text() and {"spawn", "tracker"} <= _kinds(tag)
            ),
            proc,
        )
        line = psutil.Process(proc.pid).cmdline()
        # What pkill -f matches: the launcher, its guard, the ranks, a save's forked writers.
        known = [p for p in _tagged(tag) if _safely(p.cmdline) == line]
        guards = [p for p in known if _safely(p.name) == "dualpipe-guard"]
        ranks = [p for p in known if p not in guards and _safely(p.ppid) == proc.pid]
        assert len(guards) == 1 and len(ranks) == 2, [_safely(p.name) for p in known]
        # All stopped first, then killed: none sees another die and removes the directory
        # (the guard on the launcher's exit, the launcher on a rank's), as with pkill at once.
        # The launcher dies last: its death orphans the guard's process group, and the kernel
        # wakes an orphaned group's stopped members (SIGHUP, then SIGCONT); the guard, which
        # ignores SIGHUP, would then see its parent gone and remove the directory itself.
        known.sort(key=lambda p: p.pid == proc.pid)
        for action in (psutil.Process.suspend, psutil.Process.kill):
            for victim in known:
                with contextlib.suppress(psutil.NoSuchProcess):  # a writer that just finished
                    action(victim)
        # The resource trackers go last, once the managers' deaths close their pipes: 0.16-0.30
        # s here alone, but beside CI's other leg and a second suite two were still running
        # after 5 s (2026-12-07). What the test guards against is a tracker that runs on.
        assert _survivors(tag, within_s=30.0) == []
    directories = _run_directories(proc.pid, temp)  # nobody was left to remove them ...
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    run_ranks(_manager_directory, 1, timeout_s=120)
    assert [d for d in directories if d.exists()] == []  # ... so the next launch did


def _rank_number(rank: int, world_size: int) -> int:
    return rank


def _made_by_a_process_that_ends(keep_alive: bool) -> tuple[Path, int | None]:
    """A :func:`process_tmpdir` folder made by a forked process that ends without leaving
    its block (as under ``kill -9``); with ``keep_alive``, a child it forked first keeps
    running (holding the folder, as a rank does). Returns the folder and that child's pid."""
    from megatron_dualpipe.runtime.launch import process_tmpdir

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        with process_tmpdir() as path:
            child = os.fork() if keep_alive else -1
            if child == 0:
                time.sleep(600)
                os._exit(0)
            os.write(write, f"{path}\n{child}".encode())
            os._exit(0)  # never leaves the block
    os.waitpid(pid, 0)
    text = os.read(read, 4096).decode()
    os.close(read)
    os.close(write)
    path, child = text.split("\n")
    return Path(path), int(child) if keep_alive else None


def test_a_process_tmpdir_goes_with_the_next_launch_once_nothing_holds_it(
    own_temp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train`` keeps its patched megatron/training in such a folder: a
    ``kill -9`` of the command leaves it, and the next launch removes it; not while the
    process that made it, or a child of it (a rank importing from it) lives, whatever its
    pid says (another PID namespace)."""
    from megatron_dualpipe.runtime.launch import process_tmpdir, run_ranks

    monkeypatch.setattr(tempfile, "tempdir", str(own_temp))
    left, _ = _made_by_a_process_that_ends(keep_alive=False)
    held, child = _made_by_a_process_that_ends(keep_alive=True)
    try:
        with process_tmpdir() as mine:
            assert left.parent == held.parent == mine.parent == own_temp
            assert run_ranks(_rank_number, 1, timeout_s=120) == [0]
            assert not left.exists() and held.is_dir() and mine.is_dir()
    finally:
        os.kill(child, signal.SIGKILL)  # not this process's child: its end is not ours to wait
    assert not mine.exists()
    deadline = time.monotonic() + 60
    while held.exists() and time.monotonic() < deadline:  # the lock goes with the exit
        with process_tmpdir():  # a launch: removes it once nothing holds it
            pass
    assert not held.exists()
