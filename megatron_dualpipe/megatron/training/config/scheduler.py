"""The learning-rate and weight-decay schedule of a config, as Megatron-Core's
``OptimizerParamScheduler`` takes it (and names it in its state dict)."""

from __future__ import annotations

from typing import Any

from .keys import TrainConfig

__all__ = ["scheduler_settings"]


def scheduler_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The OptimizerParamScheduler settings of ``cfg``, named as in its state dict: linear
    warm-up from 0 over ``lr_warmup_iters``, then ``lr_decay_style`` down to ``min_lr`` at
    ``lr_decay_iters`` (default ``train_iters``); constant weight decay. One step per
    iteration."""
    return {
        "max_lr": cfg.lr,
        "min_lr": cfg.min_lr,
        "lr_warmup_steps": cfg.lr_warmup_iters,
        "lr_decay_steps": cfg.lr_decay_iters or cfg.train_iters,
        "lr_decay_style": cfg.lr_decay_style,
        "start_wd": cfg.weight_decay,
        "end_wd": cfg.weight_decay,
        "wd_incr_steps": cfg.train_iters,
        "wd_incr_style": "constant",
    }
