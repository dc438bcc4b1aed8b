"""Plain torch stage modules run by Megatron-Core's own pipeline schedules.

The benchmark compares runtimes on the same stage modules (e.g. timed-sleep layers). For
Megatron's 1F1B and interleaved schedules a model chunk must be a ``MegatronModule`` with a
``config`` (pipeline sizes, dtype and hidden size for the P2P buffers) and
``set_input_tensor``, driven by a ``forward_step_func(data_iterator, model)`` that returns
the output and, on the last stage, a loss function. :class:`ModuleChunk` wraps any module
taking and returning one ``[sequence, micro-batch, hidden]`` tensor that way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from ..compat.cpu_compat import apply_cpu_compat

__all__ = [
    "ModuleChunk",
    "megatron_pipeline",
    "module_chunks",
    "mse_forward_step",
    "prepare_megatron",
]


def prepare_megatron() -> None:
    """Import (and on CPU patch) what Megatron's schedules need, e.g. before forking ranks."""
    apply_cpu_compat()


@contextlib.contextmanager
def megatron_pipeline(pp: int, timeout_s: float) -> Iterator[None]:
    """Megatron's ``parallel_state`` with ``pp`` pipeline ranks for the block."""
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, distributed_timeout_minutes=timeout_s / 60.0
    )
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


class ModuleChunk(MegatronModule):
    """One model chunk: ``module``; where data enters it reads the micro-batch, elsewhere
    the tensor Megatron set with :meth:`set_input_tensor`."""

    def __init__(
        self,
        config: TransformerConfig,
        module: nn.Module,
        *,
        pre_process: bool,
        post_process: bool,
        vp_stage: int | None,
    ):
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder
        self.module = module
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: Any) -> None:
        if isinstance(input_tensor, list):
            (input_tensor,) = input_tensor
        self.input_tensor = input_tensor

    def forward(self, data: torch.Tensor | None) -> torch.Tensor:
        x = data if self.pre_process else self.input_tensor
        if x is None:
            raise RuntimeError("a stage got no input: no data on the first, none received")
        return self.module(x)


def _mse_loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = (output**2).mean()
    return loss, {"loss": loss.detach().clone()}


def mse_forward_step(data_iterator: Any, model: ModuleChunk) -> tuple[torch.Tensor, Any]:
    """Megatron's ``forward_step_func``: the first stage reads its micro-batch; the last
    returns a mean-squared loss against zeros (Megatron divides it by the micro-batches)."""
    data = next(data_iterator) if model.pre_process else None
    return model(data), partial(_mse_loss)


def module_chunks(
    modules: Sequence[nn.Module], *, pp: int, rank: int, width: int, num_layers: int
) -> tuple[list[ModuleChunk], Callable[..., Any]]:
    """This rank's ``modules`` as Megatron chunks in Megatron's placement (chunk c on rank r
    is model stage ``c * pp + r``), and the Megatron schedule function that runs them
    (1F1B for one chunk, interleaved for more). A fp32 config of ``width`` features;
    ``batch_p2p_comm`` off: with two chunks at PP=2 it gives wrong results."""
    chunks = len(modules)
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=width,
        num_attention_heads=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        batch_p2p_comm=False,
    )
    num_stages = pp * chunks
    wrapped = [
        ModuleChunk(
            config,
            module,
            pre_process=chunk * pp + rank == 0,
            post_process=chunk * pp + rank == num_stages - 1,
            vp_stage=chunk if chunks > 1 else None,
        )
        for chunk, module in enumerate(modules)
    ]
    run = (
        megatron_schedules.forward_backward_pipelining_with_interleaving
        if chunks > 1
        else megatron_schedules.forward_backward_pipelining_without_interleaving
    )
    return wrapped, run
