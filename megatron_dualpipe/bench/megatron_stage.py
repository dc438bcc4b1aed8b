"""Sleep-op stages that Megatron-Core's own pipeline schedules can run.

Megatron's schedule functions take model chunks that are ``MegatronModule`` s with a
``config`` (a ``TransformerConfig``: pipeline sizes, dtype, hidden size for the P2P
buffers) and ``set_input_tensor``, and a ``forward_step_func(data_iterator, model)`` that
returns the chunk's output and, on the last stage, a loss function. Here a chunk wraps a
:class:`~.sleep_model.SleepStage` (the same layers the other runtimes run); activations
are Megatron's ``[sequence, micro-batch, hidden]``. Megatron imports only when this
module does: call :func:`~megatron_dualpipe.megatron.cpu_compat.apply_cpu_compat` first
on a machine without a GPU.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from .sleep_model import SleepClock, SleepCosts, SleepStage

__all__ = ["SleepMegatronStage", "build_megatron_chunks", "sleep_config", "sleep_forward_step"]


def sleep_config(pp: int, chunks: int, layers_per_share: int, width: int) -> TransformerConfig:
    """A fp32 config for ``pp`` ranks x ``chunks`` chunks of sleep layers of ``width``
    features (``batch_p2p_comm`` off: with two chunks at PP=2 it gives wrong results,
    notes/megatron-on-cpu.md)."""
    return TransformerConfig(
        num_layers=pp * layers_per_share,
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


class SleepMegatronStage(MegatronModule):
    """One model chunk: a :class:`SleepStage`; where data enters it reads the micro-batch,
    elsewhere the tensor Megatron set with :meth:`set_input_tensor`."""

    def __init__(
        self,
        config: TransformerConfig,
        stage: SleepStage,
        *,
        pre_process: bool,
        post_process: bool,
        vp_stage: int | None,
    ):
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder
        self.stage = stage
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
        return self.stage(x)


def _mse_loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = (output**2).mean()
    return loss, {"loss": loss.detach().clone()}


def sleep_forward_step(data_iterator: Any, model: SleepMegatronStage) -> tuple[torch.Tensor, Any]:
    """Megatron's ``forward_step_func``: the first stage reads its micro-batch; the last
    returns a mean-squared loss against zeros (Megatron divides it by the micro-batches)."""
    data = next(data_iterator) if model.pre_process else None
    return model(data), partial(_mse_loss)


def build_megatron_chunks(
    pp: int,
    rank: int,
    chunks: int,
    layers_per_share: int,
    width: int,
    clock: SleepClock,
    layer_s: float,
) -> list[SleepMegatronStage]:
    """This rank's chunks in Megatron's placement (chunk c on rank r is model stage
    ``c * pp + r``), each of ``layers_per_share // chunks`` layers sleeping ``layer_s``
    per F, dX and dW; stage weights seeded by stage index as elsewhere in the bench."""
    if layers_per_share % chunks:
        raise ValueError(f"layers_per_share ({layers_per_share}) must divide into {chunks} chunks")
    config = sleep_config(pp, chunks, layers_per_share, width)
    costs = SleepCosts(layer_s, layer_s, layer_s)
    num_stages = pp * chunks
    out = []
    for chunk in range(chunks):
        index = chunk * pp + rank
        torch.manual_seed(index)
        stage = SleepStage(layers_per_share // chunks, width, costs, clock)
        out.append(
            SleepMegatronStage(
                config,
                stage,
                pre_process=index == 0,
                post_process=index == num_stages - 1,
                vp_stage=chunk if chunks > 1 else None,
            )
        )
    return out
