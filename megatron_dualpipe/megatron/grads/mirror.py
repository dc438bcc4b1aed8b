"""DualPipe's two model copies under Megatron: rank r's chunk 0 and rank P-1-r's chunk 1 run
the same model stage. They start equal and stay equal: their gradients (Megatron DDP's
``main_grad``) are summed before the optimizer step, and only one copy counts towards the
gradient norm. With MoE expert bias (``moe_router_enable_expert_bias``) each copy's routers
count the tokens of its half of the micro-batches; the counts are summed too, before
Megatron updates the bias from them, so both copies update it alike. The exchange itself is
the runtime's (:mod:`megatron_dualpipe.runtime.mirror`), on the pipeline group:
:func:`mirror_pair` makes the pair (hold it across steps, as the schedule object does).

Every function is collective over the pipeline group: Megatron's (``parallel_state``)
unless ``group`` is given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.cuda_graphs import is_graph_capturing
from torch import nn

from ...runtime import DEFAULT_TIMEOUT_S
from ...runtime.mirror import Buckets, MirrorPair, param_buckets, param_grad
from ...schedules.ir import Placement
from ..schedule.checks import DualPipeConfigError

__all__ = [
    "SLICE_BYTES",
    "mirror_pair",
    "prepare_mirrors",
    "sync_mirror_expert_loads",
    "sync_mirror_gradients",
]


#: The most bytes one exchange of the mirror sum moves by default (a DDP bucket is cut
#: into slices of at most this; tests shrink it).
SLICE_BYTES = 64 * 2**20


def mirror_pair(
    group: dist.ProcessGroup | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    slice_bytes: int = SLICE_BYTES,
) -> MirrorPair:
    """This pipeline rank and its mirror rank, exchanging on the pipeline ``group`` (default
    Megatron's) at most ``slice_bytes`` per exchange; its hang monitor rests while Megatron
    captures CUDA graphs (``is_graph_capturing``)."""
    if group is None:
        group = parallel_state.get_pipeline_model_parallel_group()
    size = group.size()
    return MirrorPair(
        Placement("mirror", size, 2 * size, 2),
        group.rank(),
        group=group,
        timeout_s=timeout_s,
        bucket_bytes=slice_bytes,
        watch_paused=is_graph_capturing,
    )


def _ddp_buffers(chunk: nn.Module) -> list | None:
    """Megatron DDP's gradient buffers of a chunk (dense, then expert), or None unwrapped."""
    buffers = getattr(chunk, "buffers", None)
    if not isinstance(buffers, list):
        return None
    return buffers + list(getattr(chunk, "expert_parallel_buffers", []))


def _slices(data: torch.Tensor, slice_bytes: int) -> Buckets:
    """``data`` (contiguous, 1-d) in slices of at most ``slice_bytes``, one a bucket."""
    step = max(1, slice_bytes // data.element_size())
    return [[data[at : at + step]] for at in range(0, data.numel(), step)]


def _grad_buckets(chunk: nn.Module, slice_bytes: int) -> Buckets:
    """What the mirror exchange sends of a chunk: Megatron DDP's gradient buffers as laid
    out, in slices; with the distributed optimizer only this data-parallel rank's shard of
    each bucket (the only part reduced over the data-parallel ranks, and the only part the
    optimizer reads); unwrapped, the chunk's gradients."""
    buffers = _ddp_buffers(chunk)
    if buffers is None:
        return param_buckets(chunk, _main_grad, slice_bytes)
    pieces: Buckets = []
    for buffer in buffers:
        sharded = buffer.ddp_config.use_distributed_optimizer
        dp, dp_rank = buffer.data_parallel_world_size, buffer.data_parallel_group.rank()
        for bucket in buffer.buckets:
            data = bucket.grad_data
            if sharded:
                size = data.numel() // dp
                data = data[dp_rank * size : (dp_rank + 1) * size]
            pieces += _slices(data, slice_bytes)
    return pieces


def _bucket_layout(chunk: nn.Module) -> list[list[int]]:
    """A chunk's DDP buckets: each bucket's size, its gradients' element size and its
    parameters' sizes, in order."""
    buffers = _ddp_buffers(chunk) or []
    return [
        [bucket.grad_data.numel(), bucket.grad_data.element_size()]
        + [p.numel() for p in bucket.params_list]
        for buffer in buffers
        for bucket in buffer.buckets
    ]


def _chunk_device(chunk: nn.Module) -> torch.device:
    first = next(iter(chunk.parameters()), None)
    return torch.device("cpu") if first is None else first.device


def prepare_mirrors(
    model: Sequence[nn.Module],
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    slice_bytes: int = SLICE_BYTES,
) -> None:
    """Make each chunk 1 a copy of its mirror's chunk 0 (at most ``slice_bytes`` per
    exchange) and leave chunk 1's parameters out of the gradient norm (Megatron skips
    parameters marked ``shared``). Call once after building (and wrapping) the model.

    The copies' gradients are summed after Megatron's data-parallel reduction, which with
    the distributed optimizer leaves each rank only its shard of each DDP bucket: both
    copies of a stage must be bucketed alike, or the sum mixes shards. Megatron's DDP
    buckets only pipeline rank 0's first chunk, so under dualpipe wrap every chunk with
    ``disable_bucketing=True``; a different layout is refused here in one sentence."""
    pair = mirror_pair(group, timeout_s=timeout_s, slice_bytes=slice_bytes)
    try:
        pair.check_layouts([_bucket_layout(chunk) for chunk in model], _chunk_device(model[0]))
    except ValueError as err:
        raise DualPipeConfigError(
            f"Megatron's DDP buckets dualpipe's two copies of a stage differently ({err}): "
            "wrap every model chunk with DistributedDataParallel(..., disable_bucketing=True), "
            "as megatron-dualpipe's train does (Megatron buckets pipeline rank 0's first "
            "chunk only), or set overlap_grad_reduce off"
        ) from err
    pair.copy_params(model)
    for param in model[1].parameters():
        param.shared = True


def _main_grad(param: nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    return param_grad(param) if grad is None else grad


def sync_mirror_gradients(model: Sequence[nn.Module], pair: MirrorPair) -> None:
    """Sum the gradients (``main_grad`` under Megatron DDP, else ``.grad``) of the two copies
    of every stage on ``pair`` (see :func:`mirror_pair`), one slice of a DDP bucket per
    exchange (the extra memory: the receive buffers of the two slices in flight; the
    layouts were checked by :func:`prepare_mirrors`)."""
    slice_bytes = pair.bucket_bytes
    pair.sync_grads(model, buckets=lambda c: _grad_buckets(c, slice_bytes), check_layout=False)


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


def sync_mirror_expert_loads(model: Sequence[nn.Module], pair: MirrorPair) -> None:
    """Sum the expert-bias token counts of the two copies of every stage on ``pair``, in
    place on both (call before Megatron's ``finalize_model_grads`` updates the bias)."""
    counts = [_TokenCounts(chunk) for chunk in model]
    if not any(len(c.counts) for c in counts):
        return  # no router here, nor on the mirror rank (it holds the same two stages)
    pair.sync_grads(counts, grad_of=lambda p: p.data)
