"""Megatron's optimizer and learning-rate schedule for a :class:`~.config.TrainConfig`."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from .config import TrainConfig
from .config.scheduler import scheduler_settings

__all__ = ["build_optimizer"]


def build_optimizer(
    cfg: TrainConfig, model: list[Any]
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """``get_megatron_optimizer`` over the model chunks (Adam or SGD, gradient clipping at
    ``clip_grad``, the distributed optimizer when asked) and an ``OptimizerParamScheduler``
    with :func:`scheduler_settings`; on load, its settings are compared with the
    checkpoint's as Megatron-LM's ``override_opt_param_scheduler`` and
    ``use_checkpoint_opt_param_scheduler`` say."""
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=cfg.optimizer,
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            sgd_momentum=cfg.sgd_momentum,
            clip_grad=cfg.clip_grad,
            bf16=cfg.bf16,
            params_dtype=dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        ),
        model,
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        use_checkpoint_opt_param_scheduler=cfg.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=cfg.override_opt_param_scheduler,
        **scheduler_settings(cfg),
    )
    return optimizer, scheduler
