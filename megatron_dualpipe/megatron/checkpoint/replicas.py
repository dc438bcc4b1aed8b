"""dualpipe's mirrored copy of a stage in a checkpoint: saved once, as a replica of the
other copy, and loaded into both."""

from __future__ import annotations

from typing import Any

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.utils import unwrap_model

__all__ = ["as_mirror_replicas", "save_as_mirror_replicas"]


def _as_replica(replica_id: int | tuple[int, ...]) -> tuple[int, ...]:
    rest = (replica_id,) if isinstance(replica_id, int) else tuple(replica_id)
    return (1, *rest)


def as_mirror_replicas(chunk_state: dict[str, Any]) -> dict[str, Any]:
    """``chunk_state`` (a sharded state dict of dualpipe's mirrored copy, chunk 1) with
    every item marked a replica, so each stage is saved once and loaded into both copies;
    changed in place and returned."""
    for item in nested_values(chunk_state):
        if hasattr(item, "replica_id"):
            item.replica_id = _as_replica(item.replica_id)
    return chunk_state


def save_as_mirror_replicas(chunk: Any) -> None:
    """Make dualpipe's mirrored copy ``chunk`` (wrappers allowed) give its sharded state
    dict as replicas (:func:`as_mirror_replicas`) to whoever asks it, wrapped or bare
    (Megatron-LM's checkpointing asks both): its ``sharded_state_dict`` is replaced on the
    bare chunk."""
    bare = unwrap_model(chunk)
    own = bare.sharded_state_dict
    bare.sharded_state_dict = lambda *args, **kwargs: as_mirror_replicas(own(*args, **kwargs))
