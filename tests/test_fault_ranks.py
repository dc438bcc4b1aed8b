"""A rank that dies is noticed at once, named, and takes every other process with it.

The runtime's forked-rank launcher watches each rank's process, not only its result pipe:
a child the rank forked (dist_checkpointing's writer processes are such children) keeps a
copy of the pipe's write end, so the pipe alone would not close when the rank dies. Each
test kills for real (SIGKILL) and is bounded in time, so a regression fails instead of
hanging.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from megatron_dualpipe.megatron.checkpoint.files import TRACKER, damage, iteration_dir
from megatron_dualpipe.runtime.launch import GUARD_NAME, LaunchFailure, run_ranks
from tests.processes import as_from_a_terminal, wait_for

pytestmark = pytest.mark.multiproc

#: Long enough that only the launcher's own detection can end the call in time.
PG_TIMEOUT_S = 120.0
#: Every rank must be gone this soon after one died.
STOP_WITHIN_S = 5.0
#: The launcher's own exit after its sentence: the interpreter's teardown, 0.4-1.7 s with
#: its objects frozen out of the collector, 5.1 s once beside a second suite.
EXIT_WITHIN_S = 30.0


def _die_with_a_child_holding_the_pipe(rank: int, world_size: int, pid_file: str) -> int:
    """Rank 1 forks a child (it inherits every fd, the result pipe included), then is
    killed with SIGKILL; rank 0 waits in a collective the dead rank never joins."""
    if rank == 1:
        child = os.fork()
        if child == 0:  # the "writer": outlives its parent unless someone kills it
            time.sleep(600)
            os._exit(0)
        Path(pid_file).write_text(f"{child} {time.monotonic()}")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return rank


def test_a_rank_killed_while_its_child_holds_the_pipe_is_named_within_seconds(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "child"
    with pytest.raises(LaunchFailure) as info:
        run_ranks(
            _die_with_a_child_holding_the_pipe,
            2,
            args=(str(pid_file),),
            timeout_s=60,
            pg_timeout_s=PG_TIMEOUT_S,
        )
    stopped = time.monotonic()
    child, killed_at = pid_file.read_text().split()
    assert stopped - float(killed_at) < STOP_WITHIN_S
    failure = info.value
    assert failure.errors[0][:2] == (1, "died"), failure
    assert failure.first.startswith("rank 1 of 2 failed: it was killed by SIGKILL, signal 9")
    assert _gone_soon([int(child)]) == []  # the orphaned child went with its rank


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie left for init to reap is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or exiting while being read (ESRCH)
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone_soon(pids: list[int], within_s: float = 1.0) -> list[int]:
    """The pids still running after ``within_s`` (at once when none is)."""
    deadline = time.monotonic() + within_s
    while True:
        left = [pid for pid in pids if _running(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


# -- megatron-dualpipe train (Megatron-LM's loop) -----------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_gpt_cpu.yaml"


def _start_train(tmp_path: Path, *sets: str) -> tuple[subprocess.Popen, Path, Path]:
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    args = [arg for item in sets for arg in ("--set", item)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(TINY), *args],
        cwd=ROOT,
        stdout=out.open("w"),
        stderr=err.open("w"),
        preexec_fn=as_from_a_terminal,
    )
    return proc, out, err


def _ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    """The forked ranks (children of the train process but its guard), rank order."""
    children = [p for p in psutil.Process(proc.pid).children() if _name(p) != GUARD_NAME]
    return sorted(children, key=lambda p: p.create_time())


def _name(proc: psutil.Process) -> str | None:
    try:
        return proc.name()
    except psutil.Error:
        return None


def _writer_child(rank: psutil.Process) -> list[psutil.Process]:
    """The rank's forked checkpoint writers (same command line as the rank)."""
    try:
        return [c for c in rank.children() if c.cmdline() == rank.cmdline()]
    except psutil.Error:
        return []


@pytest.mark.megatron
@pytest.mark.route
@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_kill_9_of_a_training_rank_while_it_writes_a_checkpoint(tmp_path: Path, victim) -> None:
    """The issue's reproduction: every process gone within seconds, the dead rank named,
    the last complete checkpoint intact."""
    save = tmp_path / "ckpt"
    proc, _, err = _start_train(tmp_path, f"save={save}", "save_interval=1", "train_iters=300")

    def writing() -> list[psutil.Process] | None:
        """The ranks, once the victim writes a checkpoint and an earlier one is complete."""
        ranks = _ranks(proc)
        saved = (save / "latest_checkpointed_iteration.txt").exists()
        if saved and len(ranks) == 2 and _writer_child(ranks[victim]):
            return ranks
        return None

    ranks = wait_for("a checkpoint writer", writing, proc)
    everyone = psutil.Process(proc.pid).children(recursive=True)
    ranks[victim].kill()
    killed = time.monotonic()
    assert _gone_soon([p.pid for p in everyone], within_s=STOP_WITHIN_S) == []
    try:  # the train process itself too
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert time.monotonic() - killed < EXIT_WITHIN_S
    assert code == 2
    assert err.read_text().splitlines()[-1] == (
        f"megatron-dualpipe: error: rank {victim} of 2 failed: it was killed by SIGKILL, signal 9 "
        "before reporting a result (killed from outside, or by the out-of-memory killer)"
    )
    last = int((save / TRACKER).read_text())
    assert last is not None and damage(iteration_dir(save, last)) is None


@pytest.mark.megatron
@pytest.mark.route
@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code", "said"), [
    (signal.SIGINT, 130, "interrupted"),
    (signal.SIGTERM, 143, "terminated (SIGTERM)"),
])  # fmt: skip
def test_ctrl_c_or_sigterm_stops_every_rank_with_one_line(tmp_path, signum, code, said) -> None:
    proc, out, err = _start_train(tmp_path, "train_iters=300", "log_interval=1")
    wait_for("the first iteration", lambda: " iteration        1/" in out.read_text(), proc)
    everyone = psutil.Process(proc.pid).children(recursive=True)
    # A terminal's Ctrl-C reaches the train process only: the ranks have their own groups.
    proc.send_signal(signum)
    assert _gone_soon([p.pid for p in everyone], within_s=STOP_WITHIN_S) == []
    try:
        assert proc.wait(timeout=60) == code
    finally:
        proc.kill()
    lines = err.read_text().splitlines()
    assert lines[-1] == f"megatron-dualpipe: train {said}"
    assert not any("Traceback" in line for line in lines), lines


@pytest.mark.megatron
@pytest.mark.route
@pytest.mark.slow
def test_kill_9_of_a_rank_started_by_torchrun_style_variables(tmp_path: Path) -> None:
    """Each rank its own process (as torchrun or srun start them): the survivor stops at
    once with one line naming the rank it lost (Megatron-LM's step surfaces the executor's
    broken receive)."""
    port = str(29500 + os.getpid() % 1000)
    procs, errs = [], []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
        errs.append(tmp_path / f"stderr{rank}")
        sets = ["train_iters=3000", "log_interval=1"]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(TINY),
             *[arg for item in sets for arg in ("--set", item)]],
            cwd=ROOT, env=env, stdout=(tmp_path / f"stdout{rank}").open("w"),
            stderr=errs[-1].open("w"),
        ))  # fmt: skip
    try:
        out = tmp_path / "stdout1"  # Megatron-LM logs its iterations on the last rank
        wait_for("the second iteration", lambda: " iteration        2/" in out.read_text(),
                  procs[1])  # fmt: skip
        procs[0].kill()
        assert procs[1].wait(timeout=STOP_WITHIN_S + 60) == 2  # + the interpreter's teardown
    finally:
        for proc in procs:
            proc.kill()
    last = errs[1].read_text().splitlines()[-1]
    assert re.match(r"^megatron-dualpipe: error: (pipeline rank 1 gave up on \S+ \(peer: "
                    r"rank 0\)|a collective failed, another rank has probably died)",
                    last), last  # fmt: skip
