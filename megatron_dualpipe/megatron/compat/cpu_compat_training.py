"""Megatron-LM's training loop (``megatron.training``: ``pretrain``, ``get_model``,
``train_step``, checkpointing) on CPU + gloo, for a machine without a GPU.

:func:`megatron_training_on_cpu` applies :mod:`.cpu_compat`, gives each module of
:data:`TRAINING_SITES` (and ``megatron.training.initialize``, which sees one device) the CPU
view of torch, and while its block runs makes ``Tensor.cuda()`` the identity and
``Tensor.record_stream`` a no-op. Enter it once ``megatron.training`` resolves to the copy
to run. The sites and why: docs/megatron-on-cpu.md, "Megatron-LM's training loop on CPU".
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

from .cpu_compat import (
    _TORCH_ON_CPU,
    _CudaOnCpu,
    _no_op,
    _record_stream_is_no_op,
    _tensor_cuda_is_identity,
    _TorchOnCpu,
    apply_cpu_compat,
)

__all__ = [
    "TRAINING_SITES",
    "eager_on_cpu",
    "megatron_training_on_cpu",
    "skip_compiling_shipped_dataset_helpers",
]

#: Modules of megatron.training (and the megatron-core ones only it reaches) whose ``torch``
#: becomes the CPU view; what each assumes of CUDA (0.19): docs/megatron-on-cpu.md's table.
TRAINING_SITES: tuple[str, ...] = (
    "megatron.training.training",
    "megatron.training.utils.common_utils",
    "megatron.training.checkpointing",
    "megatron.training.models.dist_utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.timers",
)


class _CudaAsOneDevice(_CudaOnCpu):
    """``torch.cuda`` for ``megatron.training.initialize``: one device (the CPU), whose
    ``set_device`` and ``set_stream`` do nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.is_available = lambda: True
        self.device_count = lambda: 1
        self.set_device = _no_op
        self.set_stream = _no_op


class _TorchAsOneDevice(_TorchOnCpu):
    """The CPU view of torch with :class:`_CudaAsOneDevice`."""

    def __init__(self) -> None:
        super().__init__()
        self.cuda = _CudaAsOneDevice()
        self.device = _cuda_device_is_cpu


def _cuda_device_is_cpu(*args: Any, **kwargs: Any) -> torch.device:
    """``torch.device`` where ``"cuda:N"`` names the CPU (``_initialize_distributed``'s
    device id)."""
    device = torch.device(*args, **kwargs)
    return torch.device("cpu") if device.type == "cuda" else device


_TORCH_AS_ONE_DEVICE = _TorchAsOneDevice()


def skip_compiling_shipped_dataset_helpers() -> None:
    """``initialize_megatron`` has rank 0 run ``compile_helpers()``: ``make`` in
    megatron/core/datasets, where the wheel ships the compiled ``helpers_cpp`` and no
    Makefile, so it fails (``sys.exit(1)``, with or without a GPU); with ``helpers_cpp``
    importable there is nothing to compile. Call it before ``initialize_megatron``."""
    from megatron.core.datasets import utils

    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return
    utils.compile_helpers = _no_op


def eager_on_cpu() -> contextlib.AbstractContextManager[None]:
    """Without a GPU, a context in which ``torch.compile`` compiles nothing, so that
    Megatron-Core's fused functions (``megatron.core.jit.jit_fuser`` is ``torch.compile``;
    e.g. the MoE router's ``_apply_expert_bias`` under ``moe_router_enable_expert_bias``)
    run eagerly: compiling one on a CPU builds C++ kernels with inductor in its first call,
    on every rank at once, to fuse a few element-wise operations (11-19 s of
    tiny_deepseek_cpu.yaml's first iteration). With a GPU a null context: they compile."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


@contextlib.contextmanager
def megatron_training_on_cpu() -> Iterator[None]:
    """Within this block Megatron-LM's training loop runs on CPU (docs/megatron-on-cpu.md);
    a no-op context with CUDA. The module rebindings stay (forked ranks inherit them)."""
    if torch.cuda.is_available():
        yield
        return
    apply_cpu_compat()
    for module_name in TRAINING_SITES:
        importlib.import_module(module_name).torch = _TORCH_ON_CPU
    importlib.import_module("megatron.training.initialize").torch = _TORCH_AS_ONE_DEVICE
    with _tensor_cuda_is_identity(), _record_stream_is_no_op(), eager_on_cpu():
        yield
