"""DualPipe's two model copies under Megatron: rank r's chunk 0 and rank P-1-r's chunk 1 run
the same model stage. They start equal and stay equal: their gradients (Megatron DDP's
``main_grad``) are summed before the optimizer step, and only one copy counts towards the
gradient norm. The exchange itself is the runtime's (:mod:`megatron_dualpipe.runtime.mirror`).

Both functions are collective over the pipeline group: Megatron's (``parallel_state``)
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

__all__ = ["prepare_mirrors", "sync_mirror_gradients"]


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
