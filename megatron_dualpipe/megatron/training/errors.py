"""The error raised when a training run cannot start or continue (no torch import)."""

from __future__ import annotations

from ...errors import DualPipeError

__all__ = ["TrainError"]


class TrainError(DualPipeError, RuntimeError):
    """A run that failed for a reason the message states (a rank's error, a checkpoint
    that does not fit, a missing launcher setting)."""
