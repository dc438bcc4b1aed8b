"""``cuda_graph_impl: transformer_engine`` in ``train``'s loop, run as Megatron-LM's
``train`` (``megatron/training/training.py``, core_v0.16.1 to core_v0.19.0) runs it.

Megatron-LM builds one ``TECudaGraphHelper`` before its first iteration, with the model
chunks, the ``TransformerConfig``, ``seq_length``, ``micro_batch_size`` and
``optimizers=[optimizer]``; at the top of the iteration whose count since the start (or the
resumed iteration) equals ``cuda_graph_warmup_steps``, and only while the helper has not
captured yet, it calls ``create_cudagraphs()`` (TE's per-layer graphs, one per layer and
micro-batch, which the layers replay from then on; evaluation runs eagerly, as Megatron's
layers replay only in training mode); after the loop it calls ``delete_cuda_graphs()`` where
``graphs_created()``. Megatron's helper reads the step's micro-batches from Megatron's
global calculator (``get_num_microbatches``), which Megatron-LM's ``initialize`` sets up and
``train`` otherwise does not use: it is set up here, constant (no batch-size ramp-up), and
removed after the loop. A first step the optimizer skipped (a non-finite fp16 loss) moves the
start on by one, so warm-up counts successful steps. ``cuda_graph_set_manual_hooks()`` is
called there only where the forward pre-hooks were turned off (``overlap_param_gather``
with the distributed optimizer, ``should_disable_forward_pre_hook``), which ``train`` does
not run: its graphed layers need no manual hooks.

Under our schedules the helper is :func:`~..schedule.te_graphs.helper_on_this_rank`'s
(Megatron's class with our ``_get_sample_arguments``), so TE captures the graphs in the
order the rank runs them; under Megatron's own schedules it is Megatron's class. Whether a
capture ran is :func:`~..compat.version.te_graph_capture_finished` (the name changed in
0.17).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...schedules.registry import SCHEDULES
from ..compat.version import te_graph_capture_finished
from .config import TrainConfig

__all__ = ["HelperClass", "LayerGraphs", "megatron_helper"]

#: What the helper is built with: called as Megatron-LM calls ``TECudaGraphHelper``.
HelperClass = Callable[..., Any]


def megatron_helper(cfg: TrainConfig, forward_backward: Any) -> HelperClass:
    """The helper class for ``cfg``'s schedule: ours capturing the schedule
    ``forward_backward`` runs (generated, or given to its ``use_schedule``), else
    Megatron-Core's ``TECudaGraphHelper``."""
    if not SCHEDULES[cfg.pipeline_schedule].runs_ours:
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

        return TECudaGraphHelper
    from ..schedule.te_graphs import helper_on_this_rank

    return helper_on_this_rank(forward_backward.schedule_to_run)


class LayerGraphs:
    """One run's TE graphs (see the module docstring); ``helper_class`` replaces the
    helper class (default: :func:`megatron_helper`), as a test without CUDA does."""

    def __init__(
        self,
        cfg: TrainConfig,
        forward_backward: Any,
        model: list[Any],
        config: Any,
        optimizer: Any,
        helper_class: HelperClass | None = None,
    ) -> None:
        from megatron.core import num_microbatches_calculator as calculator

        calculator.init_num_microbatches_calculator(
            torch.distributed.get_rank(),
            rampup_batch_size=None,
            global_batch_size=cfg.global_batch_size,
            micro_batch_size=cfg.micro_batch_size,
            data_parallel_size=cfg.data_parallel_size,
        )
        build = helper_class or megatron_helper(cfg, forward_backward)
        self.helper = build(
            model=model,
            config=config,
            seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size,
            optimizers=[optimizer],
        )
        self.warmup_steps = cfg.cuda_graph_warmup_steps
        self.start: int | None = None

    def before_step(self, iteration: int) -> None:
        """At the top of each training iteration (``iteration`` done so far): capture once
        the warm-up steps since the start have run."""
        if self.start is None:
            self.start = iteration
        if (
            not te_graph_capture_finished(self.helper)
            and iteration - self.start == self.warmup_steps
        ):
            self.helper.create_cudagraphs()

    def after_step(self, iteration: int, success: bool) -> None:
        """After the optimizer step of iteration ``iteration`` (counted from 1): a first
        step the optimizer skipped moves the start on, as Megatron-LM's ``start_iteration``."""
        if not success and self.start == iteration - 1:
            self.start = iteration

    def close(self) -> None:
        """After the loop: delete the graphs where some were created, and Megatron's
        micro-batch calculator."""
        from megatron.core import num_microbatches_calculator as calculator

        if self.helper.graphs_created():
            self.helper.delete_cuda_graphs()
        calculator.destroy_num_microbatches_calculator()
