"""What ``train`` makes of the balance advisor's proposal: the trainer's defaults (so the
advisor models what ``train`` builds) and why its config loader would refuse the proposed
lines. Pure Python: imports :mod:`.keys` and :mod:`.reading` only."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .keys import ConfigError, TrainConfig
from .reading import load_config

__all__ = ["train_defaults", "train_refuses"]


def train_defaults() -> dict[str, Any]:
    """The trainer's defaults for the keys it has."""
    return {
        f.name: f.default
        for f in dataclasses.fields(TrainConfig)
        if f.default is not dataclasses.MISSING
    }


def train_refuses(
    config: str | Path, overrides: Iterable[str], changes: Mapping[str, Any]
) -> str | None:
    """Why ``train``'s config loader refuses ``config`` with ``overrides`` and then
    ``changes`` (the advisor's), or None."""
    applied = [
        f"{k}={'null' if v is None else str(v).lower() if v is False else v}"
        for k, v in changes.items()
    ]
    try:
        load_config(config, [*overrides, *applied])
    except ConfigError as err:
        return str(err)
    return None
