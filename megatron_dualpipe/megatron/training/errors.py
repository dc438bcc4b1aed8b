"""The error raised when a training run cannot start or continue (no torch import)."""

from __future__ import annotations

__all__ = ["TrainError"]


class TrainError(RuntimeError):
    """A run that failed for a reason the message states (a rank's error, a checkpoint
    that does not fit, a missing launcher setting)."""
