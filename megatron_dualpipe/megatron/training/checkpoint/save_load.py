"""Layout-agnostic checkpoints with ``megatron.core.dist_checkpointing``.

A checkpoint is Megatron-LM's directory layout: ``<root>/iter_0000005/`` plus
``<root>/latest_checkpointed_iteration.txt`` (see :mod:`...checkpoint.files`, which also
finds damaged checkpoints before any work). It holds

- the model: each chunk's ``sharded_state_dict()``. Our chunks keep global layer numbers,
  so the keys and offsets are those of a standard run and any pipeline schedule (and any
  PP/TP split dist_checkpointing can reshard) loads them. Under dualpipe every stage
  exists twice; the copy in chunk 1 is marked a replica, so it is saved once and loaded
  into both copies;
- the optimizer: Megatron's ``optimizer.sharded_state_dict(model_state)``, whose tensors
  are keyed by the model parameters' keys (so it is as layout-agnostic as the model) and
  whose step counter and parameter-group hyper-parameters are common to all ranks;
- common state: iteration, consumed training samples (the data position: the synthetic
  data and Megatron-Core's datasets are addressed by sample index, so the resumed run reads
  the samples the uninterrupted run would have read next), the learning-rate scheduler, the
  world size and the model-defining config keys with the model's vocabulary (checked on
  load);
- per-rank RNG states (python, numpy, torch, CUDA, Megatron's tracker), restored only
  when the world size is unchanged (they are per rank; with dropout 0 they do not affect
  the losses).

Loading takes the tracker's iteration, or ``ckpt_step``'s. The learning-rate schedule
saved must match the config's unless ``override_opt_param_scheduler`` (the config's wins)
or ``use_checkpoint_opt_param_scheduler`` (the checkpoint's wins) says otherwise, as in
Megatron-LM; a mismatch is refused before any work. A save that fails (a full disk) is
one sentence naming the iteration and the last complete checkpoint, which stays the
tracker's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ....runtime.openmp import release_thread_pool
from ...checkpoint.files import (
    TRACKER,
    CheckpointError,
    Damaged,
    contents,
    earlier_advice,
    failure_cause,
    iteration_dir,
    iterations,
    read_tracker,
    write_tracker,
    writer_errors,
)
from ...checkpoint.replicas import as_mirror_replicas
from ...compat.cpu_compat import apply_cpu_compat
from ...model.position_copies import POSITION_TABLE, mark_position_copy_replica
from ...schedule.checks import schedule_spec
from ..config import TrainConfig
from ..config.scheduler import scheduler_settings
from .writer_watch import WriterDied, writer_queue_dies_with_rank, writers_watched

__all__ = [
    "CheckpointError",
    "TrainState",
    "check_loadable",
    "load_checkpoint",
    "save_checkpoint",
]

#: Keys that define the model's parameters: a checkpoint only loads into the same model.
MODEL_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "tokenizer_type",
    "max_position_embeddings",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "add_bias_linear",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "optimizer",
    "moe_layer_freq",
    "moe_router_enable_expert_bias",
    "untie_embeddings_and_output_weights",
    "mtp_num_layers",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "qk_layernorm",
)
#: Model keys added after checkpoints were written: their value in a checkpoint without them.
_ADDED_KEYS = {"qk_layernorm": False}
#: Keys naming the tokens a run reads: a checkpoint records them, and a run resuming with
#: others says so once (:func:`data_change_note`); it is not refused (fine-tuning on other
#: data resumes this way).
DATA_KEYS = (
    "data_path",
    "train_data_path",
    "valid_data_path",
    "test_data_path",
    "mock_data",
    "tokenizer_model",
    "vocab_file",
    "merge_file",
)
#: dist_checkpointing metadata for the optimizer: keys without a per-optimizer prefix.
_OPTIMIZER_METADATA = {"chained_optim_avoid_prefix": True}


@dataclass
class TrainState:
    """Where training stands: the last finished iteration and the samples it consumed."""

    iteration: int = 0
    consumed_train_samples: int = 0


def _model_state(cfg: TrainConfig, model: list[Any]) -> dict[str, Any]:
    """Each chunk's sharded state dict; dualpipe's chunk 1 (the mirrored copy) as replicas."""
    state = {}
    for i, chunk in enumerate(model):
        # A metadata dict, as Megatron-LM passes: GPTModel's MTP chunks read it (None fails).
        chunk_state = unwrap_model(chunk).sharded_state_dict(metadata={})
        mark_position_copy_replica(chunk, chunk_state)
        if i == 1 and schedule_spec(cfg.pipeline_schedule).placement == "mirror":
            chunk_state = as_mirror_replicas(chunk_state)
        state[f"model{i}"] = chunk_state
    return state


def _rng_state() -> dict[str, Any]:
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_object(state: dict[str, Any] | None) -> ShardedObject:
    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _sharded_state(
    cfg: TrainConfig, model: list[Any], optimizer: Any, *, loading: bool, with_rng: bool
) -> dict[str, Any]:
    state: dict[str, Any] = _model_state(cfg, model)
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=loading, metadata=_OPTIMIZER_METADATA
    )
    if with_rng:
        state["rng_state"] = _rng_object(None if loading else _rng_state())
    return state


def model_settings(cfg: TrainConfig, vocab_size: int | None = None) -> dict[str, Any]:
    """The :data:`MODEL_KEYS` values of ``cfg``, with the model's vocabulary (the
    tokenizer's, padded) as ``vocab_size`` where given."""
    settings = {key: getattr(cfg, key) for key in MODEL_KEYS}
    if vocab_size is not None:
        settings["vocab_size"] = vocab_size
    return settings


def save_checkpoint(
    cfg: TrainConfig,
    model: list[Any],
    optimizer: Any,
    scheduler: OptimizerParamScheduler,
    state: TrainState,
    vocab_size: int | None = None,
) -> Path:
    """Save a checkpoint of ``state.iteration`` under ``cfg.save``; collective. Returns its
    directory. The tracker file is written after every rank has saved. ``vocab_size``: the
    model's vocabulary where a tokenizer sets it."""
    assert cfg.save is not None
    apply_cpu_compat()  # dist_checkpointing's writer assumes CUDA (no-op with CUDA)
    directory = iteration_dir(cfg.save, state.iteration)
    _on_rank_0(lambda: directory.mkdir(parents=True, exist_ok=True), cfg.save, state.iteration)
    sharded = _sharded_state(cfg, model, optimizer, loading=False, with_rng=True)
    sharded.update(
        iteration=state.iteration,
        consumed_train_samples=state.consumed_train_samples,
        opt_param_scheduler=scheduler.state_dict(),
        world_size=dist.get_world_size(),
        pipeline_schedule=cfg.pipeline_schedule,
        model_config=model_settings(cfg, vocab_size),
        data_config={key: getattr(cfg, key) for key in DATA_KEYS},
    )
    writer_queue_dies_with_rank()  # its manager goes with this rank, whatever kills it
    release_thread_pool()  # the writers dist_checkpointing forks may run parallel ops
    try:
        with writers_watched(), writer_errors() as logged:
            dist_checkpointing.save(sharded, str(directory))
    except (Exception, CheckpointException) as err:  # every rank's failure, gathered
        message = [_save_failure(cfg.save, state.iteration, err, logged)]
        if isinstance(err, CheckpointException) and err.args[:1] == ("write",):
            # Raised on every rank, with the causes on the coordinator only: say its words.
            dist.broadcast_object_list(message, src=0)
        # torch's CheckpointException is raised on every rank alike; another error is local.
        every_rank = isinstance(err, CheckpointException)
        raise CheckpointError(message[0], every_rank=every_rank) from None
    dist.barrier()
    _on_rank_0(lambda: write_tracker(cfg.save, state.iteration), cfg.save, state.iteration)
    return directory


def _on_rank_0(step: Callable[[], object], root: str, iteration: int) -> None:
    """Run a file step of the save on global rank 0 (making the directory, writing the
    tracker); collective: where it fails (the file system turned read-only, say) every rank
    raises the same :class:`CheckpointError` sentence."""
    problem: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            step()
        except OSError as err:
            cause = f"{err.strerror or err} ({getattr(err, 'filename', None) or root})"
            problem = [_save_failure(root, iteration, err, cause=cause, ranks=[0])]
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0], every_rank=True)


def _save_failure(
    root: str,
    iteration: int,
    err: BaseException,
    logged: Sequence[str] = (),
    *,
    cause: str | None = None,
    ranks: list[int] | None = None,
) -> str:
    found_ranks, found_cause = failure_cause(err, logged, root)
    ranks, cause = ranks or found_ranks, cause or found_cause
    where = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
    last = read_tracker(root)
    kept = (
        f"the last complete checkpoint is iteration {last} (the tracker still names it)"
        if last is not None
        else f"there is no complete checkpoint in {root} yet"
    )
    died = _writer_death(err)
    if died is not None:
        cause = f"a checkpoint writer process it started died ({died})"
        advice = "find what ended it (the out-of-memory killer, a kill) and resume with load"
    elif cause == "no space left on device":
        advice = f"free space in {root} or set save to another directory"
    else:
        advice = "set save to a directory every rank can write to"
    return (
        f"saving iteration {iteration} to {iteration_dir(root, iteration)} failed{where}: "
        f"{cause}; {kept}: {advice}"
    )


def _writer_death(err: BaseException) -> str | None:
    """How a writer process died, where ``err`` (or what caused it) says one did: the
    watch's :class:`WriterDied`, or a pipe to the writers that broke."""
    failures = getattr(err, "failures", None)  # torch's CheckpointException: every rank's
    pending = [err, *(failures.values() if isinstance(failures, dict) else ())]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if isinstance(current, tuple) and current:  # (exception, traceback) per rank
            current = current[0]
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, WriterDied):
            return str(current)
        if isinstance(current, (BrokenPipeError, EOFError, ConnectionResetError)):
            return f"its pipe broke: {type(current).__name__}"
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None


def _first_submission(cfg: TrainConfig) -> bool:
    """Whether ``cfg.load`` does not exist yet and is also ``cfg.save``: the first run of a
    config that saves where it resumes from, which starts from scratch (as Megatron-LM
    starts when ``--load`` holds no checkpoint)."""
    if cfg.load is None or cfg.save is None or Path(cfg.load).exists():
        return False
    return Path(cfg.load).resolve() == Path(cfg.save).resolve()


def _iteration_to_load(cfg: TrainConfig) -> int | None:
    """``ckpt_step``, else the tracker's iteration; None when ``cfg.load`` holds no
    checkpoint at all (training starts from scratch, as in Megatron-LM), a ``load`` that
    does not exist yet and is also ``save`` included. Another missing ``load`` is refused
    (a mistyped path must not start a run from scratch)."""
    assert cfg.load is not None
    root = Path(cfg.load)
    if _first_submission(cfg):
        return None
    if not root.exists():
        raise CheckpointError(
            f"load: {root} does not exist: point load at a checkpoint directory (the save "
            "directory of an earlier run), or unset it to train from scratch"
        )
    if not root.is_dir():
        raise CheckpointError(f"load: {root} is a file, not a checkpoint directory")
    if cfg.ckpt_step is not None:
        return cfg.ckpt_step
    iteration = read_tracker(root)
    if iteration is None and iterations(root):
        raise CheckpointError(
            f"{root} holds checkpoints but no latest_checkpointed_iteration.txt: "
            f"{earlier_advice(root)}"
        )
    return iteration


def check_loadable(cfg: TrainConfig, vocab_size: int | None = None) -> None:
    """Raise :class:`CheckpointError` when the checkpoint ``cfg.load`` names is missing or
    damaged, was saved for a different model (see :data:`MODEL_KEYS`), or has another
    learning-rate schedule than the config without a key saying which wins. Reads only
    files, so it can run before any process group exists. No checkpoint: nothing to do."""
    if cfg.load is None:
        return
    iteration = _iteration_to_load(cfg)
    if iteration is None:
        return
    directory = iteration_dir(cfg.load, iteration)
    if not directory.is_dir():
        named = f"{TRACKER} in {cfg.load}" if cfg.ckpt_step is None else "ckpt_step"
        raise CheckpointError(
            f"{named} names iteration {iteration}, but {directory} does not exist: "
            f"{earlier_advice(cfg.load)}"
        )
    try:
        found = contents(directory)
    except Damaged as problem:
        raise CheckpointError(
            f"checkpoint {directory}: {problem}: {earlier_advice(cfg.load, before=iteration)}"
        ) from None
    common = found.common
    saved = common["model_config"]
    ours = model_settings(cfg, vocab_size)
    for key in MODEL_KEYS:
        value = saved.get(key, _ADDED_KEYS.get(key))
        if value != ours[key]:
            raise CheckpointError(
                f"{directory}: the checkpoint was saved with {key} {value!r} but the "
                f"config has {ours[key]!r}: a checkpoint only loads into the same model"
            )
    _check_position_table(cfg, directory, found.metadata)
    _check_scheduler(cfg, directory, common["opt_param_scheduler"])


def data_change_note(cfg: TrainConfig, saved: dict[str, Any] | None, directory: Path) -> str | None:
    """A note line where ``cfg`` reads other data or another tokenizer than the run that
    saved ``directory`` (its ``data_config``: :data:`DATA_KEYS`); None where they agree or
    the checkpoint predates the record."""
    if saved is None:
        return None
    changed = [k for k in DATA_KEYS if k in saved and saved[k] != getattr(cfg, k)]
    if not changed:
        return None
    words = "; ".join(f"{k} {saved[k]!r}, now {getattr(cfg, k)!r}" for k in changed)
    return (
        f" note: {directory} was saved by a run reading other data or another tokenizer "
        f"({words}): this run goes on from its weights on what the config names now"
    )


def _check_position_table(cfg: TrainConfig, directory: Path, metadata: Any) -> None:
    """The learned position table's length, which the saved keys do not pin down where
    ``max_position_embeddings`` was left to its default (``seq_length``)."""
    if cfg.position_embedding_type != "learned_absolute":
        return
    saved = metadata.state_dict_metadata.get(POSITION_TABLE)
    if not isinstance(saved, TensorStorageMetadata):
        return
    have, want = saved.size[0], cfg.max_position_embeddings or cfg.seq_length
    if have == want:
        return
    key = "max_position_embeddings" if cfg.max_position_embeddings is not None else "seq_length"
    raise CheckpointError(
        f"{directory}: the checkpoint's learned position embeddings cover {have} positions but "
        f"the config's cover {want} ({key} {want}; max_position_embeddings defaults to "
        f"seq_length): a checkpoint only loads into the same model: set "
        f"max_position_embeddings: {have} with seq_length at most {have}, or train from scratch"
    )


#: The learning-rate scheduler's saved settings that Megatron compares on load, with the
#: config keys that set them.
_SCHEDULER_KEYS = {
    "max_lr": "lr",
    "min_lr": "min_lr",
    "lr_warmup_steps": "lr_warmup_iters",
    "lr_decay_steps": "lr_decay_iters (default: train_iters)",
    "lr_decay_style": "lr_decay_style",
    "start_wd": "weight_decay",
    "end_wd": "weight_decay",
    "wd_incr_steps": "train_iters (the weight-decay schedule's length)",
    "wd_incr_style": "the weight-decay style",
}


def _check_scheduler(cfg: TrainConfig, directory: Path, saved: dict[str, Any]) -> None:
    """Megatron's OptimizerParamScheduler asserts equal settings on load unless one of
    the two keys says which wins; say so in one sentence instead, before any work."""
    if cfg.override_opt_param_scheduler or cfg.use_checkpoint_opt_param_scheduler:
        return
    ours = scheduler_settings(cfg)
    for name, key in _SCHEDULER_KEYS.items():
        if name in saved and saved[name] != ours[name]:
            raise CheckpointError(
                f"{directory}: the checkpoint's learning-rate schedule differs from the "
                f"config's ({key}: {saved[name]!r} in the checkpoint, {ours[name]!r} now): set "
                "override_opt_param_scheduler: true to follow the config's schedule from the "
                "checkpoint's iteration on, or use_checkpoint_opt_param_scheduler: true to keep "
                "the checkpoint's"
            )


def load_checkpoint(
    cfg: TrainConfig,
    model: list[Any],
    optimizer: Any,
    scheduler: OptimizerParamScheduler,
    vocab_size: int | None = None,
) -> tuple[TrainState, Path, str | None] | None:
    """Load the checkpoint ``cfg.load`` names (``ckpt_step``, else the tracker's) into the
    model, optimizer and scheduler (and RNG states, when the world size is unchanged);
    collective. Returns the state to resume from, the directory and the
    :func:`data_change_note` (or None), or None when ``cfg.load`` holds no checkpoint
    (training starts from scratch, as in Megatron-LM)."""
    iteration = _iteration_to_load(cfg)
    if iteration is None:
        return None
    check_loadable(cfg, vocab_size)
    directory = iteration_dir(cfg.load, iteration)
    common = dist_checkpointing.load_common_state_dict(str(directory))
    same_world = common["world_size"] == dist.get_world_size()
    sharded = _sharded_state(cfg, model, optimizer, loading=True, with_rng=same_world)
    try:
        loaded = dist_checkpointing.load(sharded, str(directory))
    except (Exception, CheckpointException) as err:  # every rank's failure, gathered
        ranks, cause = failure_cause(err)
        where = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        advice = (
            "a checkpoint only loads into the same model: give the model keys of the run that "
            "saved it"
            if "shape mismatch" in cause
            else earlier_advice(cfg.load, before=iteration)
        )
        raise CheckpointError(
            f"checkpoint {directory} cannot be loaded: reading it failed{where if ranks else ''} "
            f"({cause}): {advice}",
            every_rank=isinstance(err, CheckpointException),
        ) from None
    for i, chunk in enumerate(model):
        unwrap_model(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(common["opt_param_scheduler"])
    if same_world:
        _set_rng_state(loaded["rng_state"])
    state = TrainState(common["iteration"], common["consumed_train_samples"])
    return state, directory, data_change_note(cfg, common.get("data_config"), directory)
