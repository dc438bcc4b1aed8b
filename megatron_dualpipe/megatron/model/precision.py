"""Megatron's Float16Module for model chunks placed by our schedules.

Megatron-LM wraps every model chunk of a bf16/fp16 run in ``Float16Module``: the chunk's
parameters cast to half precision, float inputs of the pipeline's first stage cast down,
outputs of its last stage cast back to fp32. It finds those ends from the pipeline rank
(``is_pp_first_stage`` / ``is_pp_last_stage``), which is wrong under our placements: under
dualpipev the loss is computed on pipeline rank 0 and the last rank's chunks feed further
stages. :class:`StageFloat16Module` is the same wrapper with the ends given.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

__all__ = ["StageFloat16Module"]


class StageFloat16Module(Float16Module):
    """``Float16Module`` whose chunk takes the data where ``pre_process`` and ends in the
    loss where ``post_process`` (as our placement says), not where Megatron's stage
    numbering would put them."""

    def __init__(
        self, config: TransformerConfig, module: nn.Module, *, pre_process: bool, post_process: bool
    ):
        super().__init__(config, module)
        # Not named pre_process/post_process: Megatron finds the wrapped model by those.
        self._takes_data = pre_process
        self._ends_in_loss = post_process

    def forward(self, *inputs: Any, fp32_output: bool = True, **kwargs: Any) -> Any:
        if self._takes_data:
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if self._ends_in_loss and fp32_output:
            outputs = float16_to_fp32(outputs)
        return outputs
