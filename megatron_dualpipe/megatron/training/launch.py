"""Start the ranks of a training run and run :func:`~.loop.run_rank` on each.

Three ways, decided by the environment:

- **torchrun** (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
  and **srun** (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, with
  ``MASTER_ADDR`` and ``MASTER_PORT`` exported by the batch script): this process is one
  rank; the launcher's world size replaces the config's ``world_size``.
- **embedded** (neither, and no GPU): this process forks ``world_size`` CPU ranks after
  importing megatron (about a second each instead of a fresh import), joined over gloo.
  Rank 0 hosts the rendezvous on a port picked here (retried on a fresh port if another
  process takes it first). A failing rank's traceback is raised here as
  :class:`LaunchError` after the others get a short grace period; the rest are killed, as
  are all ranks if this process is interrupted. Hangs end as errors through the process
  groups' timeout (``distributed_timeout_minutes``).
- with a GPU and no launcher: one rank in this process when ``world_size`` is 1; more
  need torchrun or srun.

On GPUs every rank uses NCCL and the GPU ``LOCAL_RANK`` names; on CPU, gloo, and
:func:`~megatron_dualpipe.megatron.cpu_compat.apply_cpu_compat` is applied before the
model exists. Configuration problems are reported before any process-group work.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..cpu_compat import apply_cpu_compat
from .checkpoint import check_loadable
from .config import ConfigError, TrainConfig
from .errors import TrainError
from .loop import TrainResult, run_rank
from .model import transformer_config

__all__ = ["LaunchError", "RankEnv", "launcher_env", "train"]

_HOST = "127.0.0.1"
#: After the first failing rank, how long the others get to report before being killed.
_GRACE_S = 2.0
_RENDEZVOUS_ATTEMPTS = 3


class LaunchError(TrainError):
    """Ranks could not be started or one failed; the message names the rank and its error."""


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str


def _required(name: str, launcher: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise LaunchError(
            f"{launcher} environment without {name}: export MASTER_ADDR and MASTER_PORT "
            "(the rank-0 host and a free port) before starting the ranks"
        )
    return value


def launcher_env() -> RankEnv | None:
    """The rank set by torchrun or srun, or None when neither started this process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        keys, launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK"), "torchrun"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        keys, launcher = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"), "srun"
    else:
        return None
    rank, world, local = (int(env.get(k, "0")) for k in keys)
    addr = _required("MASTER_ADDR", launcher)
    port = int(_required("MASTER_PORT", launcher))
    return RankEnv(rank, world, local, addr, port, launcher)


def _preflight(cfg: TrainConfig, source: str, on_gpu: bool) -> None:
    """Refuse what cannot run here, before any process group exists."""
    if not on_gpu:
        if cfg.bf16:
            raise ConfigError(
                f"{source}: bf16: needs GPUs (Megatron's bf16 optimizer is CUDA-only): "
                "set bf16: false on CPU"
            )
        if cfg.use_distributed_optimizer:
            raise ConfigError(
                f"{source}: use_distributed_optimizer: needs GPUs (Megatron's distributed "
                "optimizer checks for CUDA tensors): set it to false on CPU"
            )
    if cfg.save is not None and importlib.util.find_spec("psutil") is None:
        raise ConfigError(
            f"{source}: save: megatron-core's checkpoint writer needs psutil (without it a "
            "save hangs in 0.16.1): pip install psutil"
        )
    try:
        transformer_config(cfg, on_gpu=on_gpu)
    except (AssertionError, ValueError, TypeError) as err:
        raise ConfigError(
            f"{source}: Megatron-Core rejects the model configuration: {err}"
        ) from None
    check_loadable(cfg)


def train(cfg: TrainConfig, *, source: str = "config") -> TrainResult:
    """Run ``cfg`` with whatever launcher started this process (see the module docstring).

    Returns this process's result; under the embedded launcher, rank 0's, with the lines
    every rank printed. ``source`` (the config's path) prefixes configuration errors.
    """
    env = launcher_env()
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        apply_cpu_compat()
    if env is not None:
        cfg = cfg.with_world_size(env.world_size, source)
    elif on_gpu and cfg.launch_world_size > 1:
        raise LaunchError(
            f"{source}: world_size {cfg.launch_world_size} on GPUs needs a launcher: start "
            f"the ranks with torchrun --nproc-per-node ... or srun (the embedded launcher "
            "forks CPU ranks only)"
        )
    _preflight(cfg, source, on_gpu)
    if env is None and not on_gpu:
        return _run_forked(cfg)
    if env is None:
        env = RankEnv(0, 1, 0, _HOST, _free_port(), "single")
    return _run_here(cfg, env, on_gpu)


def _run_here(cfg: TrainConfig, env: RankEnv, on_gpu: bool) -> TrainResult:
    if on_gpu:
        torch.cuda.set_device(env.local_rank)
    os.environ.update(MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port))
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(minutes=cfg.distributed_timeout_minutes),
    )
    try:
        return run_rank(cfg)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# The embedded launcher.


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return sock.getsockname()[1]


def _run_forked(cfg: TrainConfig) -> TrainResult:
    world = cfg.launch_world_size
    for attempt in range(_RENDEZVOUS_ATTEMPTS):
        results, errors = _fork_once(cfg, world, _free_port())
        rendezvous_failed = errors and all(kind == "setup" for _, kind, _ in errors)
        if not rendezvous_failed or attempt + 1 == _RENDEZVOUS_ATTEMPTS:
            break
    if errors:
        rank, _, text = errors[0]
        raise LaunchError(f"rank {rank} of {world} failed: {text}")
    merged = results[0]
    merged.lines = [line for r in range(world) for line in results[r].lines]
    return merged


def _fork_once(
    cfg: TrainConfig, world: int, port: int
) -> tuple[dict[int, TrainResult], list[tuple[int, str, str]]]:
    """Fork the ranks once; returns their results and their errors (rank, kind, text),
    the earliest failure first. No rank outlives the call."""
    ctx = multiprocessing.get_context("fork")
    procs, pending = [], {}
    try:
        for rank in range(world):
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(send, os.getpid(), cfg, rank, world, port),
                name=f"rank{rank}",
            )
            proc.start()
            send.close()
            with contextlib.suppress(OSError):
                os.setpgid(proc.pid, 0)
            procs.append(proc)
            pending[receive] = rank
        return _collect(pending)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.join()
        for conn in pending:
            conn.close()


def _collect(
    pending: dict[Any, int],
) -> tuple[dict[int, TrainResult], list[tuple[int, str, str]]]:
    results: dict[int, TrainResult] = {}
    failed: list[tuple[float, int, str, str]] = []
    waiting = dict(pending)
    deadline = None
    while waiting:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait(list(waiting), timeout=timeout)
        if not ready:
            break
        for conn in ready:
            rank = waiting.pop(conn)
            try:
                status, payload, when = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                status, payload, when = (
                    "error",
                    "the rank exited without a report",
                    time.monotonic(),
                )
            if status == "ok":
                results[rank] = payload
            else:
                failed.append((when, rank, status, payload))
        if failed and deadline is None:
            deadline = time.monotonic() + _GRACE_S
    return results, [(rank, kind, text) for _, rank, kind, text in sorted(failed)]


def _rank_main(
    conn: multiprocessing.connection.Connection,
    parent: int,
    cfg: TrainConfig,
    rank: int,
    world: int,
    port: int,
) -> None:
    """One forked rank: report ("ok", result) or (kind, error) and leave by os._exit. The
    error is the message of a ConfigError or TrainError (a problem the message explains),
    else the exception and its traceback."""
    code = 1
    try:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        _die_with(parent)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR=_HOST,
            MASTER_PORT=str(port),
        )
        try:
            dist.init_process_group(
                "gloo",
                init_method="env://",
                rank=rank,
                world_size=world,
                timeout=timedelta(minutes=cfg.distributed_timeout_minutes),
            )
        except BaseException:
            _report(conn, "setup", traceback.format_exc())
        else:
            try:
                result = run_rank(cfg)
            except (ConfigError, TrainError) as err:
                _report(conn, "error", str(err))
            except BaseException as err:
                _report(conn, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
            else:
                dist.destroy_process_group()
                _report(conn, "ok", result)
        code = 0
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _report(conn: multiprocessing.connection.Connection, status: str, payload: Any) -> None:
    try:
        message = pickle.dumps((status, payload, time.monotonic()))
    except Exception:
        text = "the result could not be pickled:\n" + traceback.format_exc()
        message = pickle.dumps(("error", text, time.monotonic()))
    conn.send_bytes(message)
    conn.close()


def _die_with(parent: int) -> None:
    """Have Linux kill this rank when the launching process dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
