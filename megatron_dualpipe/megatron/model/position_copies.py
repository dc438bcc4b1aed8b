"""The MTP block's copy of the learned absolute position table, kept one parameter across
pipeline ranks.

Megatron-Core keeps the MTP block's copy of the word table one parameter but not its copy
of the position table. Here that copy is treated as Megatron treats the word table's:
marked ``shared`` and ``shared_embedding`` (:func:`mark_position_copies`), its gradient
all-reduced with the original's over the embedding group after Megatron's own finalize
(:func:`finalize_model_grads`), and saved as a replica (:func:`mark_position_copy_replica`).
Under dualpipev and dualpipe the copies share a rank and nothing here communicates. Why:
docs/megatron.md, "MTP (``mtp_num_layers``)".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.distributed import finalize_model_grads as megatron_finalize_model_grads
from megatron.core.utils import get_attr_wrapped_model
from torch import nn

__all__ = [
    "POSITION_TABLE",
    "finalize_model_grads",
    "mark_position_copies",
    "mark_position_copy_replica",
]

#: The position table's key in a chunk's state dict.
POSITION_TABLE = "embedding.position_embeddings.weight"


def _gpt(chunk: nn.Module) -> nn.Module:
    return get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)


def _has_position_copy(model: Sequence[nn.Module]) -> bool:
    """Whether the model (the same answer on every rank) has an MTP block with learned
    absolute positions: then its chunk holding the MTP layers has a copy of the table."""
    gpt = _gpt(model[0])
    learned = getattr(gpt, "position_embedding_type", None) == "learned_absolute"
    return learned and bool(getattr(gpt.config, "mtp_num_layers", None))


def _embedding_group(pg_collection: Any = None) -> Any:
    if pg_collection is not None and getattr(pg_collection, "embd", None) is not None:
        return pg_collection.embd
    return parallel_state.get_embedding_group(check_initialized=False)


def _table_in_group(model: Sequence[nn.Module], pg_collection: Any = None) -> nn.Parameter | None:
    """The position table this rank keeps in step over the embedding group: the first
    chunk's on the first pipeline rank (the original), the last chunk's on the last (the MTP
    block's copy); None where nothing is kept in step (no copy, not in the group, or a group
    of one rank, as under our placements)."""
    group = _embedding_group(pg_collection)
    if not _has_position_copy(model) or group is None or dist.get_world_size(group) < 2:
        return None
    if dist.get_rank() not in dist.get_process_group_ranks(group):
        return None
    pp = getattr(pg_collection, "pp", None) or parallel_state.get_pipeline_model_parallel_group()
    chunk = model[0] if dist.get_rank(pp) == 0 else model[-1]
    embedding = _gpt(chunk).embedding
    return embedding.position_embeddings.weight


def _copy_table(chunk: nn.Module) -> nn.Parameter | None:
    """The MTP block's copy of the position table in ``chunk``: an MTP chunk without the
    model's first stage, under learned absolute positions; else None."""
    gpt = _gpt(chunk)
    if not getattr(gpt, "mtp_process", False) or gpt.pre_process:
        return None
    if getattr(gpt, "position_embedding_type", None) != "learned_absolute":
        return None
    return gpt.embedding.position_embeddings.weight


def mark_position_copies(model: Sequence[nn.Module]) -> int:
    """Mark the MTP block's copy of the position table as Megatron marks its copy of the
    word table (``shared``: out of the gradient norm, which counts the original;
    ``shared_embedding``), under every placement (under dualpipe each rank holds one; under
    dualpipev rank 0 holds it next to the original), and the original ``shared_embedding``
    where a copy is kept in step over the embedding group. Call before wrapping in DDP,
    after the process groups exist; returns the number of copies marked."""
    copies = [table for table in map(_copy_table, model) if table is not None]
    for table in copies:
        table.shared = True
        table.shared_embedding = True
    in_group = _table_in_group(model)
    if in_group is not None:
        in_group.shared_embedding = True
    return len(copies)


def finalize_model_grads(model: list[nn.Module], *args: Any, **kwargs: Any) -> None:
    """Megatron's ``finalize_model_grads`` (same arguments), then the position table's
    gradient all-reduced between its original and the MTP block's copy."""
    megatron_finalize_model_grads(model, *args, **kwargs)
    pg_collection = kwargs.get("pg_collection")
    table = _table_in_group(model, pg_collection)
    if table is None:
        return
    grad = getattr(table, "main_grad", None)
    grad = table.grad if grad is None else grad
    if grad is None:  # this side had no gradient for it: add nothing
        grad = table.grad = torch.zeros_like(table)
    dist.all_reduce(grad, group=_embedding_group(pg_collection))


def mark_position_copy_replica(chunk: nn.Module, state: dict[str, Any]) -> None:
    """In ``chunk``'s sharded state dict, make the MTP block's copy of the position table a
    replica of the first stage's (as ``tie_word_embeddings_state_dict`` does for the word
    table)."""
    item = state.get(POSITION_TABLE)
    if not isinstance(item, ShardedTensor) or _copy_table(chunk) is None:
        return
    rest = (item.replica_id,) if isinstance(item.replica_id, int) else tuple(item.replica_id)
    item.replica_id = (1, *rest[1:])
