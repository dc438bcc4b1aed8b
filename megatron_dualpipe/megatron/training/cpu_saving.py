"""Let ``megatron.core.dist_checkpointing`` save on a machine without CUDA.

megatron-core 0.16.1's torch_dist writer assumes CUDA in two places (see
:data:`_CUDA_SITES`); :func:`allow_cpu_saving` rebinds the name ``torch`` in those two
modules to a view whose ``torch.cuda.synchronize`` does nothing and whose
``torch.cuda.current_device`` is the CPU, as :mod:`megatron_dualpipe.megatron.cpu_compat`
does for the rest of megatron-core. Nothing changes when CUDA is available.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import torch

__all__ = ["allow_cpu_saving"]


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` for dist_checkpointing on a machine without CUDA: no-op synchronize,
    the CPU as current device; the rest is the real ``torch.cuda``."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.synchronize = lambda *args, **kwargs: None
        self.current_device = lambda: torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` with :class:`_CudaOnCpu` as ``torch.cuda``."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


#: megatron-core 0.16.1 dist_checkpointing modules that assume CUDA while saving:
#: filesystem_async.py:230 torch.cuda.synchronize() after staging tensors to the host,
#: state_dict_saver.py:252 a failure flag on torch.cuda.current_device().
_CUDA_SITES = (
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)


def allow_cpu_saving() -> None:
    """Rebind ``torch`` in the modules of :data:`_CUDA_SITES` when CUDA is absent."""
    if torch.cuda.is_available():
        return
    for name in _CUDA_SITES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _TorchOnCpu):
            module.torch = _TorchOnCpu()
