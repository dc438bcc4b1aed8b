"""Start the ranks of a training run and run :func:`~.loop.run_rank` on each.

Three ways, decided by the environment:

- **torchrun** (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
  and **srun** (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, with
  ``MASTER_ADDR`` and ``MASTER_PORT`` exported by the batch script): this process is one
  rank; the launcher's world size replaces the config's ``world_size``.
- **embedded** (neither, and no GPU): this process forks ``world_size`` CPU ranks after
  importing megatron (about a second each instead of a fresh import), joined over gloo
  (:mod:`megatron_dualpipe.runtime.launch`). Rank 0 hosts the rendezvous on a port picked
  here (retried on a fresh port if another process takes it first). A failing rank's
  traceback is raised here as :class:`LaunchError` after the others get a short grace
  period; the rest are killed, as are all ranks if this process is interrupted. Hangs end
  as errors through the process groups' timeout (``distributed_timeout_minutes``). This
  process holds the save directory's lock (:mod:`.save_lock`); under torchrun and srun,
  global rank 0 does.
- with a GPU and no launcher: one rank in this process when ``world_size`` is 1; more
  need torchrun or srun.

On GPUs every rank uses NCCL and the GPU ``LOCAL_RANK`` names; on CPU, gloo, and
:func:`~megatron_dualpipe.megatron.compat.cpu_compat.apply_cpu_compat` is applied before the
model exists. Configuration problems are reported before any process-group work.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from ...errors import DualPipeError
from ...runtime.launch import pick_port, run_ranks
from ...runtime.rank_env import RankEnv, launcher_env
from ...runtime.watchdog import PipelineCommError, peer_lost
from ..checkpoint.files import check_fresh_save
from ..checkpoint.lock import SaveDirectoryInUse, save_lock
from ..compat.cpu_compat import apply_cpu_compat
from ..model.layer_specs import te_missing
from ..schedule.checks import cuda_device_max_connections
from .checkpoint.save_load import CheckpointError, check_loadable
from .config import ConfigError, TrainConfig, blame
from .data.datasets import check_data_files
from .data.tokenizer import build_tokenizer, model_vocab_size
from .errors import TrainError
from .loop import TrainResult, run_rank
from .model import transformer_config, transformer_impl
from .tensorboard import check_tensorboard

__all__ = ["LaunchError", "train"]

_HOST = "127.0.0.1"
logger = logging.getLogger(__name__)


class LaunchError(TrainError):
    """Ranks could not be started or one failed; the message names the rank and its error."""


#: Bytes one token of a micro-batch takes while a step holds it: tokens, labels and position
#: ids (int64) and the loss mask (float32); and what each micro-batch adds beside them.
_BYTES_PER_TOKEN = 28
_BYTES_PER_MICROBATCH = 2048


#: Bytes of Megatron-Core's GPT dataset index per sample it is built for (its sample and
#: shuffle indices, at most 8 bytes an entry, and the document index beside them).
_INDEX_BYTES_PER_SAMPLE = 24


def _check_step_input(cfg: TrainConfig, source: str, ranks_here: int) -> None:
    """Refuse a step whose micro-batches (every rank builds the step's list of them), or a
    run whose dataset index (``train_iters x global_batch_size`` samples, built where a
    chunk reads), do not fit in half of this machine's memory over the ranks it runs."""
    total = _machine_memory()
    if total is None:  # not a POSIX system: nothing to compare
        return
    m, mbs = cfg.num_microbatches, cfg.micro_batch_size
    need = m * (mbs * cfg.seq_length * _BYTES_PER_TOKEN + _BYTES_PER_MICROBATCH)
    gib = 2.0**30
    if need * ranks_here > total // 2:
        raise ConfigError(
            f"{blame(source, 'global_batch_size')}: global_batch_size: "
            f"a step's {m} micro-batches of {mbs} x "
            f"{cfg.seq_length} tokens take {need / gib:.1f} GiB of input on each of the "
            f"{ranks_here} ranks here, beyond half of this machine's {total / gib:.0f} GiB: "
            "lower global_batch_size (or seq_length)"
        )
    if not (cfg.uses_data_files or cfg.mock_data):
        return  # the synthetic samples are made from their index: no index is held
    samples = cfg.train_iters * cfg.global_batch_size
    index = samples * _INDEX_BYTES_PER_SAMPLE
    if index * ranks_here > total // 2:
        raise ConfigError(
            f"{blame(source, 'train_iters')}: train_iters: "
            f"{cfg.train_iters} steps of {cfg.global_batch_size} "
            f"samples make Megatron-Core's dataset index {samples:,} samples long, about "
            f"{index / gib:.0f} GiB on each of the {ranks_here} ranks here, beyond half of this "
            f"machine's {total / gib:.0f} GiB: lower train_iters (or global_batch_size)"
        )


def _machine_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _ranks_here(cfg: TrainConfig, env: RankEnv | None) -> int:
    """How many ranks of the run this machine holds: the embedded launcher's world size, a
    launcher's ``LOCAL_WORLD_SIZE`` (torchrun), else one."""
    if env is None:
        return cfg.launch_world_size
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else 1


def _preflight(cfg: TrainConfig, source: str, on_gpu: bool, ranks_here: int) -> None:
    """Refuse what cannot run here, before any process group exists."""
    if cfg.cuda_graph_impl != "none" and not on_gpu:
        raise ConfigError(
            f"{blame(source, 'cuda_graph_impl')}: cuda_graph_impl: "
            f"{cfg.cuda_graph_impl} captures CUDA graphs, and this "
            "machine has no CUDA device: set cuda_graph_impl: none here"
        )
    _check_step_input(cfg, source, ranks_here)
    if not on_gpu and cfg.use_distributed_optimizer:
        raise ConfigError(
            f"{blame(source, 'use_distributed_optimizer')}: use_distributed_optimizer: "
            "needs GPUs (Megatron's distributed "
            "optimizer checks for CUDA tensors): set it to false on CPU"
        )
    if cfg.save is not None and importlib.util.find_spec("psutil") is None:
        raise ConfigError(
            f"{blame(source, 'save')}: save: "
            "megatron-core's checkpoint writer needs psutil (without it a "
            "save hangs in 0.16.1): pip install psutil"
        )
    missing = te_missing() if cfg.transformer_impl == "transformer_engine" else None
    if missing is not None:
        raise ConfigError(
            f"{blame(source, 'transformer_impl')}: transformer_impl: "
            "transformer_engine needs a CUDA device and Transformer "
            f"Engine, and this machine has {missing}: set transformer_impl: local, or leave it "
            "unset (then local here, transformer_engine where both are present)"
        )
    if cfg.fp8 is not None and transformer_impl(cfg) == "local":
        raise ConfigError(
            f"{blame(source, 'fp8')}: fp8: "
            "FP8 training runs through Transformer Engine's layers, and this "
            "run builds Megatron-Core's local ones: set transformer_impl: transformer_engine "
            "on a machine with CUDA and Transformer Engine, or unset fp8"
        )
    if "moe_act" in (cfg.recompute_modules or "").split() and transformer_impl(cfg) == "local":
        raise ConfigError(
            f"{blame(source, 'recompute_modules')}: recompute_modules: "
            "moe_act recomputes the grouped-GEMM experts' "
            "activation, and this run builds Megatron-Core's local experts (grouped GEMM comes "
            "with transformer_impl: transformer_engine): set that on a machine with CUDA and "
            "Transformer Engine, or recompute moe instead"
        )
    try:
        transformer_config(cfg, on_gpu=on_gpu)
    except (AssertionError, ValueError, TypeError) as err:
        raise ConfigError(
            f"{source}: Megatron-Core rejects the model configuration: {err}"
        ) from None
    tokenizer = build_tokenizer(cfg, source)
    check_data_files(cfg, source, None if tokenizer is None else tokenizer.vocab_size)
    check_tensorboard(cfg, source)
    check_loadable(cfg, model_vocab_size(cfg, tokenizer))


def train(cfg: TrainConfig, *, source: str = "config") -> TrainResult:
    """Run ``cfg`` with whatever launcher started this process (see the module docstring).

    Returns this process's result; under the embedded launcher, rank 0's, with the lines
    every rank printed. ``source`` (the config's path) prefixes configuration errors.
    """
    env = launcher_env()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        _set_cuda_device_max_connections(cfg)
    else:
        apply_cpu_compat()
    if env is not None:
        cfg = cfg.with_world_size(env.world_size, source)
    elif on_gpu and cfg.launch_world_size > 1:
        raise LaunchError(
            f"{source}: world_size {cfg.launch_world_size} on GPUs needs a launcher: start "
            f"the ranks with torchrun --nproc-per-node ... or srun (the embedded launcher "
            "forks CPU ranks only)"
        )
    _preflight(cfg, source, on_gpu, _ranks_here(cfg, env))
    if env is None and not on_gpu:
        with _save_locked(cfg):  # the forked ranks inherit it
            return _run_forked(cfg)
    if env is None:
        env = RankEnv(0, 1, 0, _HOST, pick_port(), "single")
    return _run_here(cfg, env, on_gpu)


def _set_cuda_device_max_connections(cfg: TrainConfig) -> None:
    """``CUDA_DEVICE_MAX_CONNECTIONS`` by Megatron-LM's rule, before this process makes its
    CUDA context (:func:`~..checks.cuda_device_max_connections`); a value the launching
    shell exported is kept, with Megatron-LM's warning where it works against the rule."""
    value, warning = cuda_device_max_connections(
        tensor_parallel=cfg.tensor_model_parallel_size,
        overlap=cfg.overlap_moe_expert_parallel_comm,
        current=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    )
    if value is not None:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = value
    if warning is not None:
        logger.warning("%s", warning)


def _run_here(cfg: TrainConfig, env: RankEnv, on_gpu: bool) -> TrainResult:
    if on_gpu:
        torch.cuda.set_device(env.local_rank)
    os.environ.update(MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port))
    try:
        with _c10d_log_held():
            dist.init_process_group(
                "nccl" if on_gpu else "gloo",
                init_method="env://",
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(minutes=cfg.distributed_timeout_minutes),
            )
    except RuntimeError as err:  # torch's DistStoreError and DistNetworkError among them
        raise LaunchError(_rendezvous_failure(env, err)) from None
    try:
        prefix = f"rank {env.rank} of {env.world_size}: "
        with (
            _one_line_failures(prefix, "the launcher's log names it"),
            _save_locked(cfg, env.rank, env.world_size),
        ):
            return run_rank(cfg)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _one_line_failures(prefix: str, hint: str) -> Iterator[None]:
    """A lost peer (dead, stopped or hung) as one :class:`LaunchError` line: the pipeline
    wait that gave up (it names the peer), or the collective that failed."""
    try:
        yield
    except PipelineCommError as err:
        raise LaunchError(f"{prefix}{err}") from err
    except RuntimeError as err:
        if isinstance(err, DualPipeError) or not _is_communication_error(err):
            raise  # ours say what happened already
        text = str(err)
        why = (
            f"another rank has probably died or stopped ({hint})"
            if peer_lost(text) or "timed out" in text.lower()
            else "the communication backend failed"
        )
        raise LaunchError(f"{prefix}a collective failed, {why}: {_first_line(err)}") from err


@contextlib.contextmanager
def _save_locked(cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> Iterator[None]:
    """Hold ``save``'s lock (:mod:`.save_lock`) on global rank 0 for the block, and refuse
    (holding it) a ``save`` with another run's complete checkpoints that this run does not
    load (:func:`~..checkpoint.files.check_fresh_save`); with more than one rank in this process
    group, collective: every rank raises rank 0's refusal."""
    with contextlib.ExitStack() as held:
        refusal: list[DualPipeError | None] = [None]
        if cfg.save is not None and rank == 0:
            try:
                held.enter_context(save_lock(cfg.save))
                check_fresh_save(cfg.save, cfg.load)
            except (SaveDirectoryInUse, CheckpointError) as err:
                refusal = [type(err)(str(err), every_rank=True)]
        if world_size > 1:
            dist.broadcast_object_list(refusal, src=0)
        if refusal[0] is not None:
            raise refusal[0]
        yield


_JOINED = re.compile(r"(\d+)/(\d+) clients joined")
#: A line of c10's log (``[E1202 16:55:51.939312040 socket.cpp:1028] [c10d] ...``).
_C10D_LOG = re.compile(r"^\[[EWIF]\d{4} [^\]]*\] \[c10d\]")
#: The lines of a c10 error's C++ stack trace, as its ``what()`` carries it into a log line.
_CPP_FRAMES = ("Exception raised from ", "frame #", "<omitting python frames>")


@contextlib.contextmanager
def _c10d_log_held() -> Iterator[None]:
    """Hold what is written to stderr (file descriptor 2: torch's C++ side writes there)
    while the block runs, then write it back without C++ stack traces: c10d's rendezvous
    logs each failed try with the c10 error's ``what()``, the message and some 36 lines of
    frames. Where the block raises, c10d's own log lines go too: the rendezvous error's
    sentence says what they said."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hold
        yield
        return
    failed = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = _without_cpp_frames(held.read().decode(errors="replace"), failed)
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


def _without_cpp_frames(text: str, without_c10d: bool) -> str:
    """``text`` less the C++ stack traces in it (and c10d's log lines, ``without_c10d``)."""
    kept, in_trace = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith(_CPP_FRAMES):
            in_trace = True
            continue
        if in_trace and not line.strip():
            continue  # the blank line closing a trace
        in_trace = False
        if not (without_c10d and _C10D_LOG.match(line)):
            kept.append(line)
    return "".join(kept)


def _rendezvous_failure(env: RankEnv, err: RuntimeError) -> str:
    """The sentence for a rendezvous that failed: the port taken, the peers that never
    came, the rank-0 host out of reach."""
    text, where = " ".join(str(err).split()), f"{env.master_addr}:{env.master_port}"
    me = f"rank {env.rank} of {env.world_size}"
    if "EADDRINUSE" in text or "address already in use" in text:
        return (
            f"{me}: MASTER_PORT {env.master_port} is already in use on this machine, so the "
            f"rendezvous cannot listen on {where}: choose a free port"
        )
    joined = _JOINED.search(text)
    if joined:
        return (
            f"{me}: only {joined.group(1)} of the {joined.group(2)} ranks joined the rendezvous "
            f"at {where} before the timeout: start all {env.world_size} ranks with this "
            "MASTER_ADDR and MASTER_PORT, or raise distributed_timeout_minutes"
        )
    if "trying to connect to" in text or "Connection refused" in text:
        return (
            f"{me}: could not reach the rendezvous at {where} (rank 0 hosts it) before the "
            "timeout: start rank 0, or check MASTER_ADDR and MASTER_PORT"
        )
    return f"{me}: the rendezvous at {where} failed: {_first_line(err)}"


def _is_communication_error(err: RuntimeError) -> bool:
    """Whether ``err`` comes from gloo or NCCL (a peer that went away, a timeout)."""
    text = str(err)
    return "gloo" in text or "NCCL" in text or "Connection closed by peer" in text


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


# --------------------------------------------------------------------------------------
# The embedded launcher.


def _run_forked(cfg: TrainConfig) -> TrainResult:
    """Fork the configured world size here (the runtime's launcher) and return rank 0's
    result with the lines every rank printed."""
    world = cfg.launch_world_size
    results = run_ranks(
        _train_rank,
        world,
        args=(cfg,),
        timeout_s=None,
        pg_timeout_s=60.0 * cfg.distributed_timeout_minutes,
        threads_per_rank=max(1, (os.cpu_count() or 1) // world),
        plain_errors=(ConfigError, TrainError, CheckpointError, SaveDirectoryInUse),
        failure_as=lambda failure: LaunchError(failure.cause),
    )
    merged = results[0]
    merged.lines = [line for result in results for line in result.lines]
    return merged


def _train_rank(rank: int, world_size: int, cfg: TrainConfig) -> TrainResult:
    del rank, world_size  # the launcher set RANK / WORLD_SIZE and the process group
    with _one_line_failures("", "the launcher names a rank that died or stopped"):
        return run_rank(cfg)
