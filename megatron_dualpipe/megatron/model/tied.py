"""Parameters one pipeline rank holds in two of its chunks, kept as one.

Under dualpipev and dualpipe, the word embedding and its copies (a tied output layer, the
MTP block's embedding) can sit in two chunks of one rank: the parameters with the same
global name (:mod:`.names`) in different chunks are tied, their gradients summed locally,
the copies marked ``shared`` and every member ``shared_embedding``, as Megatron marks its
own copies. Megatron's embedding group is left with one rank
(:func:`~.placement.embedding_ranks`). Which copy is the original, and why: docs/megatron.md,
"Tied embeddings".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.utils import unwrap_model
from torch import nn

from .names import global_named_parameters

__all__ = [
    "copy_tied_params",
    "mark_tied_copies",
    "release_unused_output_weight",
    "sum_tied_gradients",
    "tied_groups",
]


def release_unused_output_weight(chunk: nn.Module) -> None:
    """Drop the output layer's own weight where Megatron never uses it: in a chunk with an
    MTP block but no embedding, tied embeddings feed the output layer the MTP block's copy
    of the embedding (``GPTModel.shared_embedding_or_output_weight``), as Megatron skips the
    weight where the embedding is in the same chunk. Without this the chunk would hold a
    parameter that never gets a gradient, named like the embedding."""
    if (
        getattr(chunk, "share_embeddings_and_output_weights", False)
        and getattr(chunk, "mtp_process", False)
        and not chunk.pre_process
        and chunk.post_process
    ):
        chunk.output_layer.weight = None


def tied_groups(model: Sequence[nn.Module]) -> list[list[nn.Parameter]]:
    """Groups of this rank's parameters that are one parameter: the same global name in more
    than one chunk; the original first (the first model stage's chunk's, else the first
    chunk's). Empty for one chunk."""
    holders: dict[str, list[nn.Parameter]] = {}
    for chunk in sorted(model, key=lambda c: not getattr(unwrap_model(c), "pre_process", False)):
        for name, param in global_named_parameters(chunk).items():
            holders.setdefault(name, []).append(param)
    return [params for params in holders.values() if len(params) > 1]


def mark_tied_copies(model: Sequence[nn.Module]) -> int:
    """Mark the copies ``shared`` and every member ``shared_embedding`` (call before wrapping
    in Megatron's DDP); returns the number of groups."""
    groups = tied_groups(model)
    for params in groups:
        for i, param in enumerate(params):
            param.shared_embedding = True
            if i:
                param.shared = True
    return len(groups)


@torch.no_grad()
def copy_tied_params(model: Sequence[nn.Module]) -> None:
    """Make every copy equal to its original (after building or loading)."""
    for original, *copies in tied_groups(model):
        for copy in copies:
            copy.copy_(original)


def _grad(param: nn.Parameter) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


@torch.no_grad()
def sum_tied_gradients(model: Sequence[nn.Module]) -> None:
    """Give every member of a group the sum of the group's gradients (``main_grad`` under
    Megatron's DDP, else ``.grad``), as Megatron's embedding all-reduce does across ranks."""
    for params in tied_groups(model):
        grads = [_grad(p) for p in params]
        present = [g for g in grads if g is not None]
        if not present:
            continue
        total = torch.stack(present).sum(dim=0)
        for param, grad in zip(params, grads, strict=True):
            if grad is None:
                param.grad = total.clone()
            else:
                grad.copy_(total)
