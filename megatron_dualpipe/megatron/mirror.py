"""DualPipe's two model copies under Megatron: rank r's chunk 0 and rank P-1-r's chunk 1 run
the same model stage. They start equal and stay equal: their gradients (Megatron DDP's
``main_grad``) are summed before the optimizer step, and only one copy counts towards the
gradient norm. With MoE expert bias (``moe_router_enable_expert_bias``) each copy's routers
count the tokens of its half of the micro-batches; the counts are summed too, before
Megatron updates the bias from them, so both copies update it alike. The exchange itself is
the runtime's (:mod:`megatron_dualpipe.runtime.mirror`).

Every function is collective over the pipeline group: Megatron's (``parallel_state``)
unless ``group`` is given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from ..runtime import DEFAULT_TIMEOUT_S
from ..runtime.mirror import copy_mirror_params, param_grad, sync_mirror_grads
from .placement import placement_of

__all__ = ["prepare_mirrors", "sync_mirror_expert_loads", "sync_mirror_gradients"]


def _where(group: dist.ProcessGroup | None) -> dict:
    if group is None:
        group = parallel_state.get_pipeline_model_parallel_group()
    return {
        "placement": placement_of("dualpipe", group.size()),
        "rank": group.rank(),
        "group": group,
    }


def prepare_mirrors(
    model: Sequence[nn.Module],
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Make each chunk 1 a copy of its mirror's chunk 0 and leave chunk 1's parameters out of
    the gradient norm (Megatron skips parameters marked ``shared``). Call once after
    building (and wrapping) the model."""
    copy_mirror_params(model, **_where(group), timeout_s=timeout_s)
    for param in model[1].parameters():
        param.shared = True


def _main_grad(param: nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    return param_grad(param) if grad is None else grad


def sync_mirror_gradients(
    model: Sequence[nn.Module],
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Sum the gradients (``main_grad`` under Megatron DDP, else ``.grad``) of the two copies
    of every stage."""
    sync_mirror_grads(model, **_where(group), grad_of=_main_grad, timeout_s=timeout_s)


class _TokenCounts(nn.Module):
    """The routers' token counts (``local_tokens_per_expert``) of one chunk as parameters
    sharing the counts' storage, so that the runtime's exchange sums them in place."""

    def __init__(self, chunk: nn.Module):
        super().__init__()
        self.counts = nn.ParameterList(
            nn.Parameter(module.local_tokens_per_expert)
            for module in chunk.modules()
            if getattr(module, "local_tokens_per_expert", None) is not None
        )


def sync_mirror_expert_loads(
    model: Sequence[nn.Module],
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Sum the expert-bias token counts of the two copies of every stage, in place on both
    (call before Megatron's ``finalize_model_grads`` updates the bias)."""
    counts = [_TokenCounts(chunk) for chunk in model]
    if not any(len(c.counts) for c in counts):
        return  # no router here, nor on the mirror rank (it holds the same two stages)
    sync_mirror_grads(counts, **_where(group), grad_of=lambda p: p.data, timeout_s=timeout_s)
