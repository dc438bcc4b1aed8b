"""Reading a training config: a YAML file and ``--set key=value`` overrides, each value
converted to its key's type, then checked (:mod:`.rules`). No torch or megatron import."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from ....schedules.config_values import override_origins
from .keys import (
    FIELDS,
    INT_OR_STRING,
    NUMBER,
    TYPES,
    WORD_LISTS,
    ConfigError,
    TrainConfig,
    base_type,
    is_required,
)
from .rules import validated
from .run_name import run_name

__all__ = ["load_config", "parse_overrides"]


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> TrainConfig:
    """Read, override and validate a YAML config; raises :class:`ConfigError`.

    ``overrides`` are ``key=value`` strings (the CLI's ``--set``); their values are
    converted to the key's type. ``run_name`` defaults to the file's stem, the schedule and
    the overrides (:func:`~.run_name.run_name`).
    """
    values = _read_yaml_values(path)
    overrides = list(overrides)
    overridden = parse_overrides(overrides)
    values.update(overridden)
    source, origins = override_origins(path, overrides)
    return _config_from_values(values, source, Path(path).stem, origins)


def _read_yaml_values(path: str | Path) -> dict[str, Any]:
    """A YAML config's keys and values, each checked against its key's type; raises
    :class:`ConfigError` naming the file (unreadable, not YAML, unknown key, wrong type)."""
    source = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"{source}: cannot read the config: {err.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else None
        raise ConfigError(f"{source}: not valid YAML: {where or _one_line(err)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys to values at the top level")
    return {str(k): _coerce(source, str(k), v) for k, v in raw.items()}


def _config_from_values(
    values: dict[str, Any],
    source: str,
    stem: str,
    origins: Mapping[str, str] | None = None,
) -> TrainConfig:
    """Validate ``values`` (known keys, typed as :func:`parse_overrides` types them) into a
    config. The default ``run_name`` is :func:`~.run_name.run_name` of ``stem`` (the
    config's name), the schedule and the keys in ``origins`` (those given on the command
    line), so that runs which differ keep their own outputs. Raises :class:`ConfigError`
    naming ``source``, or for a key in ``origins`` where its value came from (``--set``, a
    flag)."""
    schedule = values.get("pipeline_schedule", FIELDS["pipeline_schedule"].default)
    given = {key: values[key] for key in origins or {} if key in values}
    values = {"run_name": run_name(stem, schedule, given), **values}
    missing = [n for n, f in FIELDS.items() if is_required(f) and n not in values]
    if missing:
        raise ConfigError(f"{source}: {missing[0]}: required key missing")
    return validated(TrainConfig(**values), source, origins or {})


def parse_overrides(overrides: Iterable[str], source: str = "--set") -> dict[str, Any]:
    """``["key=value", ...]`` to typed values; raises :class:`ConfigError` naming
    ``source`` (where the values came from: ``--set``, a command-line flag)."""
    values: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"{source} {item}: write key=value")
        values[key] = _from_text(source, key, text.strip())
    return values


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _check_key(source: str, key: str) -> type:
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{source}: {key}: unknown key{hint}")
    return TYPES[key]


#: How a key's value is spelt on a command line, and each type named in an error.
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _coerce(source: str, key: str, value: Any) -> Any:
    """A YAML value checked against the key's type (ints accepted as floats; float
    literals YAML 1.1 reads as strings, such as ``1e-4``, accepted as floats)."""
    base, optional = base_type(_check_key(source, key))
    if value is None and optional:
        return None
    if base is bool and isinstance(value, bool):
        return value
    if base is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if base is float and not isinstance(value, bool):
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str) and NUMBER.match(value.strip()):
            return float(value)
    if base is str and isinstance(value, str):
        return value
    if key in WORD_LISTS and isinstance(value, list) and value:
        return " ".join(str(v) for v in value)
    if key in INT_OR_STRING and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    nullable = " or null" if optional else ""
    raise ConfigError(
        f"{source}: {key}: expected {_NAMES[base]}{nullable}, got {value!r} "
        f"({type(value).__name__})"
    )


def _from_text(source: str, key: str, text: str) -> Any:
    """An override's text converted to the key's type."""
    base, optional = base_type(_check_key(source, key))
    if optional and text.lower() in ("null", "none", "~", ""):
        return None
    try:
        if base is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError
        if base is int:
            return int(text)
        if base is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{source}: {key}: expected {_NAMES[base]}, got {text!r}") from None
    return text
