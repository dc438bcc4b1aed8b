"""``cuda_graph_impl: full_iteration`` under our schedules: the forward-backward function
wrapped as Megatron-LM wraps its own.

Megatron-LM's ``train`` wraps whatever ``get_forward_backward_func()`` returns in
Megatron-Core's ``FullCudaGraphWrapper`` (``megatron/core/full_cuda_graph.py``, the same
constructor from 0.16.1 to 0.19.2): called with keywords only, it reads every micro-batch
of a step into static buffers first (``data_read``: ``num_microbatches`` items from the
iterator, or from each chunk's iterator where the model has several chunks), runs the
first ``cuda_graph_warmup_steps`` steps eagerly, captures the next one whole with
``torch.cuda.graph`` and replays that graph every step after, returning the captured
step's result (whose tensors each replay rewrites). :func:`full_iteration_step` does the
same with :class:`~.forward_backward.DualPipeForwardBackward` in its graph-safe mode; the
wrapper is a parameter (``wrapper``), so that a test without CUDA can hand in a stand-in
with the same contract.

What a caller must do, as with Megatron's wrapper: read the losses from the returned
list after the call (not inside the step), and give every chunk's data as dictionaries
of tensors with one shape per step (:func:`chunk_iterators`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .forward_backward import DualPipeForwardBackward

__all__ = ["ForwardBackward", "GraphWrapper", "chunk_iterators", "full_iteration_step"]

#: Megatron's forward-backward signature, called with keywords.
ForwardBackward = Callable[..., list[Any]]
#: Makes the whole-step graph wrapper: (forward-backward function, warm-up steps) -> the
#: wrapped function (Megatron's ``FullCudaGraphWrapper`` by default).
GraphWrapper = Callable[[ForwardBackward, int], ForwardBackward]


def megatron_wrapper(forward_backward: ForwardBackward, warmup_steps: int) -> ForwardBackward:
    """Megatron-Core's ``FullCudaGraphWrapper`` around ``forward_backward``, as
    Megatron-LM's ``train`` builds it (needs CUDA when it captures)."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    return FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=warmup_steps)


def full_iteration_step(
    forward_backward: DualPipeForwardBackward,
    warmup_steps: int,
    wrapper: GraphWrapper | None = None,
) -> ForwardBackward:
    """``forward_backward`` (graph-safe: built with ``graph_safe=True``) wrapped for
    whole-step CUDA graphs by ``wrapper`` (default: Megatron's ``FullCudaGraphWrapper``),
    which runs ``warmup_steps`` steps eagerly, then captures one and replays it. Raises
    ValueError, before any step, for an object that is not graph-safe."""
    if not forward_backward.graph_safe:
        raise ValueError(
            f"{forward_backward!r} is not graph-safe, and a whole-step graph cannot hold its "
            "host waits: build it with graph_safe=True"
        )
    return (wrapper or megatron_wrapper)(forward_backward, warmup_steps)


def chunk_iterators(items: Sequence[Any], chunks: Iterable[Any], read: Callable) -> list[Iterator]:
    """What ``FullCudaGraphWrapper.data_read`` takes for a model of several chunks: one
    iterator per chunk over the step's ``items``, each item ``read(item, chunk)`` (a
    dictionary of tensors, or of None where that chunk reads nothing) up front, so that the
    wrapper can copy it into its static buffers."""
    return [iter([read(item, chunk) for item in items]) for chunk in chunks]
