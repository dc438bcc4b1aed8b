"""The training configuration (no torch or megatron import): :mod:`.keys` the key table
(:class:`TrainConfig`), :mod:`.reading` the YAML file and ``--set`` overrides, :mod:`.rules`
and :mod:`.data_rules` the checks a config meets before any rank starts, :mod:`.run_name` a
run's folder name. It imports the pure-Python schedules and the adapter's schedule checks,
nothing of the run."""

from __future__ import annotations

from .data_rules import DATA_PATH_KEYS
from .keys import OPTIMIZE_AFTER, ConfigError, ConfigKey, TrainConfig, config_keys
from .reading import load_config, parse_overrides
from .rules import ConfigSource, blame, config_source

__all__ = [
    "DATA_PATH_KEYS",
    "OPTIMIZE_AFTER",
    "ConfigError",
    "ConfigKey",
    "ConfigSource",
    "TrainConfig",
    "blame",
    "config_keys",
    "config_source",
    "load_config",
    "parse_overrides",
]
