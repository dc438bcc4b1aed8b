"""The Slurm launchers (scripts/slurm/*.sbatch) hold their contract.

- The CPU launcher, on a real Slurm (``bash .ci/slurm_up.sh``: two pretend nodes on this
  machine), starts one rank per task across nodes that rendezvous from SLURM_* variables,
  trains end to end, and makes ``sbatch --wait`` return the training's exit code: 0 with the
  iteration log lines, non-zero with the one-sentence error for a bad configuration; a
  rank killed mid-step ends the job non-zero within a minute, named in its output.
- The GPU launcher (no GPUs here) hands srun the right rendezvous, NCCL settings and
  arguments, and refuses an allocation that is not one task per GPU; checked with stand-in
  ``srun`` / ``scontrol`` commands.

Until ``megatron-dualpipe train`` exists the end-to-end run uses a stand-in trainer
(tests/data/slurm_probe.py: the same arguments, a gloo all_reduce over all ranks).
The real-Slurm tests are marked slow (each submits real jobs) and skipped, with the reason,
where sbatch or the controller is missing; the controller is asked only when one of them runs.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_SCRIPT = ROOT / "scripts" / "slurm" / "pretrain_cpu.sbatch"
GPU_SCRIPT = ROOT / "scripts" / "slurm" / "pretrain_gpu.sbatch"
PROBE = ROOT / "tests" / "data" / "slurm_probe.py"
TRAIN_CONFIG = ROOT / "configs" / "tiny_gpt_cpu.yaml"
# Slurm kills a job after this many minutes; the test gives up a little later.
JOB_TIME_LIMIT_MIN = 2
WAIT_TIMEOUT_S = 60 * JOB_TIME_LIMIT_MIN + 30


@functools.cache
def _slurm_missing() -> str | None:
    """Why the real-Slurm tests cannot run here, or None (asked once per session)."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "sbatch/sinfo not on PATH (run `bash .ci/slurm_up.sh` to test the launchers)"
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=5
        )
    except subprocess.TimeoutExpired:  # a controller that is down makes sinfo retry for ~15 s
        return "Slurm controller not answering; start it with `bash .ci/slurm_up.sh`"
    except OSError as err:
        return f"sinfo failed ({err}); start Slurm with `bash .ci/slurm_up.sh`"
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["no output"])[0]
        return f"Slurm controller not reachable ({first}); start it with `bash .ci/slurm_up.sh`"
    usable = [s for s in proc.stdout.split() if re.match(r"(idle|mix|alloc|compl)", s)]
    if len(usable) < 2:
        return f"Slurm has {len(usable)} usable nodes, the tests need 2 (`bash .ci/slurm_up.sh`)"
    return None


@pytest.fixture
def slurm() -> None:
    """Skips the test, saying why, where no Slurm controller with two nodes answers."""
    missing = _slurm_missing()
    if missing is not None:
        pytest.skip(missing)


def needs_slurm(test: Callable[..., None]) -> Callable[..., None]:
    """A real-Slurm test: slow, and run only where the controller answers."""
    return pytest.mark.slow(pytest.mark.usefixtures("slurm")(test))


@dataclass
class Job:
    """A finished batch job: ``sbatch --wait``'s exit code and the job's output file."""

    returncode: int
    output: str


def _sbatch(
    tmp_path: Path, config: Path, *train_args: str, stand_in: bool, tasks_per_node: int
) -> tuple[list[str], dict[str, str], str]:
    """The ``sbatch --wait`` command of the CPU launcher on 2 nodes, its environment and
    the job's name."""
    name = f"test-slurm-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("TRAIN_CMD", None)
    if stand_in:
        env["TRAIN_CMD"] = f"{sys.executable} {PROBE}"
    cmd = [
        "sbatch",
        "--wait",
        "--parsable",
        f"--job-name={name}",
        f"--output={tmp_path}/job-%j.out",
        f"--chdir={ROOT}",
        "--nodes=2",
        f"--ntasks-per-node={tasks_per_node}",
        f"--time={JOB_TIME_LIMIT_MIN}",
        str(CPU_SCRIPT),
        str(config),
        *train_args,
    ]
    return cmd, env, name


def _submit(
    tmp_path: Path, config: Path, *train_args: str, stand_in: bool, tasks_per_node: int
) -> Job:
    """``sbatch --wait`` the CPU launcher on 2 nodes; return its exit code and output."""
    cmd, env, name = _sbatch(
        tmp_path, config, *train_args, stand_in=stand_in, tasks_per_node=tasks_per_node
    )
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=WAIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={name}"], check=False)
        raise
    job_id = proc.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch did not submit: {proc.stdout}{proc.stderr}"
    out = tmp_path / f"job-{job_id}.out"
    return Job(proc.returncode, out.read_text() if out.exists() else "")


def _probe_config(tmp_path: Path) -> Path:
    config = tmp_path / "probe.yaml"
    config.write_text("pipeline_schedule: 1f1b\ntrain_iters: 1\n")
    return config


@needs_slurm
def test_cpu_launcher_ranks_rendezvous_across_nodes(tmp_path: Path) -> None:
    """2 nodes x 2 tasks: ranks from SLURM_PROCID, local ranks per node, one gloo group."""
    job = _submit(
        tmp_path,
        _probe_config(tmp_path),
        "--set",
        "train_iters=3",
        stand_in=True,
        tasks_per_node=2,
    )
    assert job.returncode == 0, job.output
    assert re.search(r"4 tasks, master n1:\d+", job.output), job.output
    seen = set(re.findall(r"probe: rank (\d)/4 local (\d) node (\S+) all_reduce ok", job.output))
    assert seen == {("0", "0", "n1"), ("1", "1", "n1"), ("2", "0", "n2"), ("3", "1", "n2")}, (
        job.output
    )
    assert job.output.count("train_iters=3") == 4, job.output


@needs_slurm
@pytest.mark.megatron
@pytest.mark.route
def test_cpu_launcher_trains_end_to_end(tmp_path: Path) -> None:
    """2 nodes x 1 task, 3 iterations of the tiny CPU config: exit code 0, one loss line per
    iteration."""
    job = _submit(
        tmp_path,
        TRAIN_CONFIG,
        *("--set", "train_iters=3", "--set", "log_interval=1"),
        stand_in=False,
        tasks_per_node=1,
    )
    assert job.returncode == 0, job.output
    logged = re.findall(r"iteration\s+(\d+)/\s*3 \|.*\blm loss: (\S+)", job.output)
    assert [it for it, _ in logged] == ["1", "2", "3"], job.output
    assert all(math.isfinite(float(loss)) for _, loss in logged), job.output
    assert "Traceback" not in job.output, job.output


@needs_slurm
@pytest.mark.megatron
@pytest.mark.route
def test_cpu_launcher_bad_config_fails_with_one_sentence(tmp_path: Path) -> None:
    """A bad configuration: sbatch --wait returns non-zero, the output says what to change."""
    job = _submit(
        tmp_path,
        TRAIN_CONFIG,
        "--set",
        "pipeline_schedule=nosuch",
        stand_in=False,
        tasks_per_node=1,
    )
    assert job.returncode != 0, job.output
    assert re.search(r"error: .*'nosuch'.*dualpipev", job.output), job.output
    assert "Traceback" not in job.output, job.output


@needs_slurm
def test_cpu_launcher_missing_config_is_refused(tmp_path: Path) -> None:
    """The launcher itself refuses a config path that does not exist, before srun."""
    job = _submit(tmp_path, tmp_path / "nope.yaml", stand_in=True, tasks_per_node=1)
    assert job.returncode == 2, job.output
    assert "nope.yaml not found" in job.output, job.output
    assert "srun" not in job.output, job.output


def _task_pid(job_id: str, task: int) -> int | None:
    """The pid of the training process of task ``task`` of job ``job_id`` (this machine
    runs every pretend node), or None before it exists. Its children (DataLoader workers)
    share its environment and command line, and after the pids wrap around one can have a
    lower pid: the process taken is the one whose parent is none of them."""
    wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={task}".encode()}
    parents = {}
    for proc in Path("/proc").iterdir():
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
            command = (proc / "cmdline").read_bytes()
            status = (proc / "status").read_text()
        except OSError:
            continue
        if wanted <= environ and b"megatron_dualpipe" in command and b"train" in command:
            parents[int(proc.name)] = int(status.split("\nPPid:")[1].split()[0])
    return next((pid for pid, parent in parents.items() if parent not in parents), None)


@needs_slurm
@pytest.mark.megatron
@pytest.mark.route
def test_a_rank_killed_mid_step_ends_the_job_within_a_minute(tmp_path: Path) -> None:
    """kill -9 of rank 1's process in the middle of training: srun's --kill-on-bad-exit
    ends the other ranks, the job ends non-zero within 60 s, and its output names the dead
    rank (srun's task number is the rank)."""
    cmd, env, name = _sbatch(
        tmp_path, TRAIN_CONFIG,
        *("--set", "train_iters=5000", "--set", "log_interval=1"),
        stand_in=False, tasks_per_node=1,
    )  # fmt: skip
    env["TRAIN_CMD"] = f"{sys.executable} -m megatron_dualpipe train"
    sbatch = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        job_id = sbatch.stdout.readline().strip().split(";")[0]
        assert job_id.isdigit(), job_id
        out = tmp_path / f"job-{job_id}.out"
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while not (out.exists() and re.search(r"iteration +2/", out.read_text())):
            assert time.monotonic() < deadline and sbatch.poll() is None, "no training step"
            time.sleep(0.2)
        pid = _task_pid(job_id, 1)
        assert pid is not None, "rank 1's process not found"
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        code = sbatch.wait(timeout=WAIT_TIMEOUT_S)
        ended_after = time.monotonic() - killed
    finally:
        if sbatch.poll() is None:
            sbatch.kill()
            subprocess.run(["scancel", f"--name={name}"], check=False)
    output = out.read_text()
    assert code != 0, output
    assert ended_after < 60, output
    assert re.search(r"srun: error: n\d: task 1: Killed", output), output
    assert "Traceback" not in output, output


# --------------------------------------------------------------------------------------
# The GPU launcher, with stand-in srun and scontrol (runs anywhere bash does).


#: Stands in for a task's trainer (megatron-dualpipe, or python -m ...): what it ran with.
_TASK_PROBE = """#!/usr/bin/env bash
echo "$(basename "$0") $* | RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK"
"""


def _run_gpu_script(
    tmp_path: Path, hosts: int = 2, trainer: str = "megatron-dualpipe", **slurm_env: str
) -> tuple[subprocess.CompletedProcess, str, str]:
    """Run pretrain_gpu.sbatch as a batch job's shell would, with ``hosts`` nodes gpu7,
    gpu8, ...; return it, what srun got, and what srun's task 3 (local rank 3 of node
    gpu7) ran. The stand-in srun runs the task's shell as Slurm would; ``trainer`` is the
    command on the task's PATH (megatron-dualpipe, or python only)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record, ran = tmp_path / "srun.txt", tmp_path / "task.txt"
    (bin_dir / "scontrol").write_text(
        f"#!/usr/bin/env bash\nfor ((i = 7; i < {7 + hosts}; i++)); do echo gpu$i; done\n"
    )
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        f"{{ printf '%s\\n' \"$@\"; env | grep -E '^(MASTER|NCCL|TORCH_NCCL|CUDA|SRUN|OMP)'; }}"
        f" > {record}\n"
        'while [[ $1 != bash ]]; do shift; done\n'
        f'SLURM_PROCID=3 SLURM_LOCALID=3 "$@" > {ran} 2>&1\n'
    )
    (bin_dir / trainer).write_text(_TASK_PROBE)
    for tool in ("scontrol", "srun", trainer):
        (bin_dir / tool).chmod(0o755)
    config = tmp_path / "cfg.yaml"
    config.write_text("train_iters: 1\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("SLURM_", "NCCL_", "CUDA_", "TRAIN_CMD", "TASK_SETUP", "CONTAINER_", "SRUN_")
        )
    }
    env.pop("MASTER_PORT", None)
    env.update(
        # the task finds the trainer here only (bash and coreutils from the system)
        PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
        SLURM_JOB_ID="123457",
        SLURM_JOB_NODELIST="gpu[7-8]",
        SLURM_NNODES="2",
        SLURM_NTASKS="16",
        SLURM_NTASKS_PER_NODE="8",
        SLURM_GPUS_ON_NODE="8",
        SLURM_CPUS_PER_TASK="6",
    )
    env.update(slurm_env)
    proc = subprocess.run(
        ["bash", str(GPU_SCRIPT), str(config), "--set", "pipeline_schedule=dualpipev"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    read = [path.read_text() if path.exists() else "" for path in (record, ran)]
    return proc, read[0], read[1]


def test_gpu_launcher_hands_srun_rendezvous_nccl_and_arguments(tmp_path: Path) -> None:
    proc, srun, ran = _run_gpu_script(tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = srun.splitlines()
    assert lines[:3] == ["--kill-on-bad-exit=1", "bash", "-c"]  # no container, no SRUN_ARGS
    assert "export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID" in srun
    cfg = str(tmp_path / "cfg.yaml")
    tail = ["--config", cfg, "--set", "pipeline_schedule=dualpipev"]
    # The command is chosen inside the task (in a container, the image's), not by the batch
    # shell: the task's arguments start with the trainer's.
    assert lines[lines.index("srun-task") + 1 :][: len(tail)] == tail, srun
    assert ran == f"megatron-dualpipe train {' '.join(tail)} | RANK=3 WORLD_SIZE=16 LOCAL_RANK=3\n"
    env = dict(line.split("=", 1) for line in lines if re.match(r"^[A-Z_]+=", line))
    assert env["MASTER_ADDR"] == "gpu7"
    assert env["MASTER_PORT"] == str(20000 + 123457 % 10000)
    assert env["SRUN_CPUS_PER_TASK"] == "6"
    assert env["OMP_NUM_THREADS"] == "6"
    # Set by train from the config (Megatron-LM's rule), not forced to 1 here: 1 would
    # serialise the MoE all-to-all that overlap_moe_expert_parallel_comm hides.
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "NCCL_DEBUG" in env


def test_gpu_launcher_task_falls_back_to_python_m_where_the_command_is_missing(
    tmp_path: Path,
) -> None:
    proc, _, ran = _run_gpu_script(tmp_path, trainer="python")
    assert proc.returncode == 0, proc.stderr
    assert ran.startswith("python -m megatron_dualpipe train --config "), ran


def test_gpu_launcher_task_setup_runs_in_the_task_before_training(tmp_path: Path) -> None:
    """TASK_SETUP (e.g. the install, where the image lacks megatron-core) runs in the
    task's shell, under a lock, before the trainer; one that fails ends the task."""
    done = tmp_path / "setup.txt"
    proc, _, ran = _run_gpu_script(tmp_path, TASK_SETUP=f"echo $SLURM_PROCID > {done}")
    assert proc.returncode == 0, proc.stderr
    assert done.read_text() == "3\n"
    assert ran.startswith("megatron-dualpipe train --config "), ran
    failed = tmp_path / "failed"
    failed.mkdir()
    _, _, ran = _run_gpu_script(failed, TASK_SETUP="echo no space left >&2; exit 7")
    assert ran == "no space left\n", ran


def test_gpu_launcher_train_cmd_is_run_by_the_task(tmp_path: Path) -> None:
    proc, srun, ran = _run_gpu_script(tmp_path, TRAIN_CMD="megatron-dualpipe train --verbose")
    assert proc.returncode == 0, proc.stderr
    assert ran.startswith("megatron-dualpipe train --verbose --config "), ran


@pytest.mark.parametrize(
    ("visible", "local_rank"),
    [
        (None, "3"),  # every GPU of the node
        ("0,1,2,3,4,5,6,7", "3"),  # every GPU, listed
        ("5", "0"),  # Slurm bound one GPU to the task (--gpus-per-task=1, --gpu-bind)
        ("4,5", "0"),  # two of the node's eight: the first it sees
    ],
)
def test_gpu_launcher_device_is_local_rank_only_where_each_task_sees_every_gpu(
    tmp_path: Path, visible: str | None, local_rank: str
) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    proc, _, ran = _run_gpu_script(tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    assert ran.endswith(f"LOCAL_RANK={local_rank}\n"), ran


def test_gpu_launcher_runs_each_task_in_the_container_with_srun_args(tmp_path: Path) -> None:
    proc, srun, ran = _run_gpu_script(
        tmp_path,
        CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:25.09-py3",
        CONTAINER_MOUNTS="/lustre:/lustre,/home:/home",
        SRUN_ARGS="--cpu-bind=none --label",
    )
    assert proc.returncode == 0, proc.stderr
    lines = srun.splitlines()
    assert lines[: lines.index("bash")] == [
        "--kill-on-bad-exit=1",
        "--container-image=nvcr.io#nvidia/pytorch:25.09-py3",
        f"--container-workdir={Path.cwd()}",
        "--container-mounts=/lustre:/lustre,/home:/home",
        "--cpu-bind=none",
        "--label",
    ]
    assert "image nvcr.io#nvidia/pytorch:25.09-py3" in proc.stdout
    assert ran.startswith("megatron-dualpipe train --config "), ran


def test_gpu_launcher_passes_on_a_cuda_device_max_connections_the_submitter_set(
    tmp_path: Path,
) -> None:
    proc, srun, _ = _run_gpu_script(tmp_path, CUDA_DEVICE_MAX_CONNECTIONS="32")
    assert proc.returncode == 0, proc.stderr
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32" in srun.splitlines()


def test_gpu_launcher_takes_the_first_of_many_hosts(tmp_path: Path) -> None:
    """A node list longer than a pipe buffer must not kill the script (SIGPIPE)."""
    proc, srun, _ = _run_gpu_script(tmp_path, hosts=20000)
    assert proc.returncode == 0, proc.stderr
    assert "MASTER_ADDR=gpu7" in srun.splitlines()


def test_gpu_launcher_refuses_other_than_one_task_per_gpu(tmp_path: Path) -> None:
    proc, srun, _ = _run_gpu_script(tmp_path, SLURM_NTASKS_PER_NODE="4")
    assert proc.returncode == 2
    assert "--ntasks-per-node (4) must equal --gpus-per-node (8)" in proc.stderr
    assert srun == ""


def test_gpu_launcher_refuses_an_allocation_without_gpus(tmp_path: Path) -> None:
    proc, srun, _ = _run_gpu_script(tmp_path, SLURM_GPUS_ON_NODE="")
    assert proc.returncode == 2
    assert "no GPUs in this allocation" in proc.stderr
    assert srun == ""


@pytest.mark.parametrize(
    "script", [CPU_SCRIPT, GPU_SCRIPT, ROOT / ".ci" / "slurm_up.sh", ROOT / ".ci" / "slurm_down.sh"]
)
def test_scripts_parse(script: Path) -> None:
    """bash -n: every launcher and CI script is valid bash."""
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
