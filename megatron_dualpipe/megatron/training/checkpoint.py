"""Layout-agnostic checkpoints with ``megatron.core.dist_checkpointing``.

A checkpoint is Megatron-LM's directory layout: ``<root>/iter_0000005/`` plus
``<root>/latest_checkpointed_iteration.txt``. It holds

- the model: each chunk's ``sharded_state_dict()``. Our chunks keep global layer numbers,
  so the keys and offsets are those of a standard run and any pipeline schedule (and any
  PP/TP split dist_checkpointing can reshard) loads them. Under dualpipe every stage
  exists twice; the copy in chunk 1 is marked a replica, so it is saved once and loaded
  into both copies;
- the optimizer: Megatron's ``optimizer.sharded_state_dict(model_state)``, whose tensors
  are keyed by the model parameters' keys (so it is as layout-agnostic as the model) and
  whose step counter and parameter-group hyper-parameters are common to all ranks;
- common state: iteration, consumed training samples (the data position: the synthetic
  data is addressed by sample index), the learning-rate scheduler, the world size and the
  model-defining config keys (checked on load);
- per-rank RNG states (python, numpy, torch, CUDA, Megatron's tracker), restored only
  when the world size is unchanged (they are per rank; with dropout 0 they do not affect
  the losses).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import unwrap_model

from ..checks import schedule_spec
from ..cpu_compat import apply_cpu_compat
from .config import TrainConfig
from .errors import TrainError

__all__ = [
    "CheckpointError",
    "TrainState",
    "check_loadable",
    "load_checkpoint",
    "save_checkpoint",
]

TRACKER = "latest_checkpointed_iteration.txt"
#: Keys that define the model's parameters: a checkpoint only loads into the same model.
MODEL_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
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
)
#: dist_checkpointing metadata for the optimizer: keys without a per-optimizer prefix.
_OPTIMIZER_METADATA = {"chained_optim_avoid_prefix": True}


class CheckpointError(TrainError):
    """A checkpoint that cannot be loaded into this run; the message says why."""


@dataclass
class TrainState:
    """Where training stands: the last finished iteration and the samples it consumed."""

    iteration: int = 0
    consumed_train_samples: int = 0


def _iteration_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _as_replica(replica_id: int | tuple[int, ...]) -> tuple[int, ...]:
    rest = (replica_id,) if isinstance(replica_id, int) else tuple(replica_id)
    return (1, *rest)


def _model_state(cfg: TrainConfig, model: list[Any]) -> dict[str, Any]:
    """Each chunk's sharded state dict; dualpipe's chunk 1 (the mirrored copy) as replicas."""
    state = {}
    for i, chunk in enumerate(model):
        # A metadata dict, as Megatron-LM passes: GPTModel's MTP chunks read it (None fails).
        chunk_state = unwrap_model(chunk).sharded_state_dict(metadata={})
        if i == 1 and schedule_spec(cfg.pipeline_schedule).placement == "mirror":
            for item in nested_values(chunk_state):
                if hasattr(item, "replica_id"):
                    item.replica_id = _as_replica(item.replica_id)
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


def save_checkpoint(
    cfg: TrainConfig,
    model: list[Any],
    optimizer: Any,
    scheduler: OptimizerParamScheduler,
    state: TrainState,
) -> Path:
    """Save a checkpoint of ``state.iteration`` under ``cfg.save``; collective. Returns its
    directory. The tracker file is written after every rank has saved."""
    assert cfg.save is not None
    apply_cpu_compat()  # dist_checkpointing's writer assumes CUDA (no-op with CUDA)
    directory = _iteration_dir(cfg.save, state.iteration)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sharded = _sharded_state(cfg, model, optimizer, loading=False, with_rng=True)
    sharded.update(
        iteration=state.iteration,
        consumed_train_samples=state.consumed_train_samples,
        opt_param_scheduler=scheduler.state_dict(),
        world_size=dist.get_world_size(),
        pipeline_schedule=cfg.pipeline_schedule,
        model_config={key: getattr(cfg, key) for key in MODEL_KEYS},
    )
    dist_checkpointing.save(sharded, str(directory))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(cfg.save) / TRACKER).write_text(f"{state.iteration}\n", encoding="utf-8")
    dist.barrier()
    return directory


def latest_iteration(root: str) -> int | None:
    """The iteration the tracker file under ``root`` names, or None without one."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text(encoding="utf-8").strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def check_loadable(cfg: TrainConfig) -> None:
    """Raise :class:`CheckpointError` when the latest checkpoint under ``cfg.load`` was
    saved for a different model (see :data:`MODEL_KEYS`); reads only its common state, so
    it can run before any process group exists. No checkpoint there: nothing to check."""
    if cfg.load is None:
        return
    iteration = latest_iteration(cfg.load)
    if iteration is None:
        return
    directory = _iteration_dir(cfg.load, iteration)
    saved = dist_checkpointing.load_common_state_dict(str(directory))["model_config"]
    for key in MODEL_KEYS:
        if saved.get(key) != getattr(cfg, key):
            raise CheckpointError(
                f"{directory}: the checkpoint was saved with {key} {saved.get(key)!r} but the "
                f"config has {getattr(cfg, key)!r}: a checkpoint only loads into the same model"
            )


def load_checkpoint(
    cfg: TrainConfig,
    model: list[Any],
    optimizer: Any,
    scheduler: OptimizerParamScheduler,
) -> tuple[TrainState, Path] | None:
    """Load the latest checkpoint under ``cfg.load`` into the model, optimizer and
    scheduler (and RNG states, when the world size is unchanged); collective. Returns the
    state to resume from and the directory, or None when ``cfg.load`` holds no tracker
    file (training starts from scratch, as in Megatron-LM)."""
    assert cfg.load is not None
    iteration = latest_iteration(cfg.load)
    if iteration is None:
        return None
    check_loadable(cfg)
    directory = _iteration_dir(cfg.load, iteration)
    common = dist_checkpointing.load_common_state_dict(str(directory))
    same_world = common["world_size"] == dist.get_world_size()
    sharded = _sharded_state(cfg, model, optimizer, loading=True, with_rng=same_world)
    loaded = dist_checkpointing.load(sharded, str(directory))
    for i, chunk in enumerate(model):
        unwrap_model(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(common["opt_param_scheduler"])
    if same_world:
        _set_rng_state(loaded["rng_state"])
    state = TrainState(common["iteration"], common["consumed_train_samples"])
    return state, directory
