"""Typed dataclasses from a config's raw values (YAML keys mirroring Megatron-LM's flags),
with one-sentence errors: the pure-Python reading the cost model and the balance advisor
share. Keys a dataclass does not name are ignored (a training config holds many)."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .ir import ScheduleError

__all__ = [
    "ConfigValueError",
    "check_positive",
    "override_origins",
    "read_fields",
    "read_values",
]

T = TypeVar("T")
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


class ConfigValueError(ScheduleError):
    """A config value the cost model cannot read; the message names the source and the key."""


def read_values(path: str | Path, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """A YAML config's top-level mapping with ``key=value`` overrides applied (each value
    read as a YAML scalar: ``4``, ``true``, ``null``, else the text as given)."""
    source = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigValueError(f"{source}: cannot read the config: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigValueError(f"{source}: not valid YAML: {' '.join(str(err).split())}") from None
    except UnicodeDecodeError:
        raise ConfigValueError(f"{source}: not valid YAML: not UTF-8 text") from None
    if not isinstance(raw, dict):
        raise ConfigValueError(f"{source}: expected a mapping of keys to values at the top level")
    values = {str(k): v for k, v in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigValueError(f"--set {item}: write key=value")
        values[key.strip()] = _scalar(text.strip())
    return values


def override_origins(path: str | Path, overrides: Iterable[str]) -> tuple[str, dict[str, str]]:
    """Whom an error blames: ``(source, origins)``, where ``origins`` maps each overridden
    key to its ``--set key=value`` (a problem with that key is the option's) and ``source``
    names the file, with the overrides when there are any (a problem with another key
    may come from their combination)."""
    origins = {item.partition("=")[0].strip(): f"--set {item}" for item in overrides}
    if not origins:
        return str(path), origins
    return f"{path} with {' '.join(origins.values())}", origins


def _scalar(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, int | float | bool | str) or value is None else text


def read_fields(
    cls: type[T],
    values: Mapping[str, Any],
    source: str,
    origins: Mapping[str, str] | None = None,
    **extra: Any,
) -> T:
    """``cls`` (a dataclass) from the keys of ``values`` it names, checked against the
    field types (``int``, ``float``, ``bool``, ``str``, optional ones, and ``object`` for
    free-form values) and against ``cls.__post_init__``; ``extra`` fields are passed as
    given, and null stands for the default of a field that cannot be null. Raises
    :class:`ConfigValueError` naming the key and ``source``, or the key's entry in
    ``origins`` (:func:`override_origins`)."""
    origins = origins or {}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = dict(extra)
    for field in dataclasses.fields(cls):
        unset = values.get(field.name) is None and not _optional(hints[field.name])
        if unset and not _required(field):
            continue  # null: the default, for keys this dataclass does not let be null
        if field.name in extra or field.name not in values:
            if field.name not in extra and _required(field):
                raise ConfigValueError(f"{source}: {field.name}: required key missing")
            continue
        where = origins.get(field.name, source)
        kwargs[field.name] = _typed(where, field.name, values[field.name], hints[field.name])
    try:
        return cls(**kwargs)
    except ConfigValueError:
        raise
    except ScheduleError as err:  # "key: what is wrong"
        raise ConfigValueError(f"{origins.get(str(err).split(':')[0], source)}: {err}") from None


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _optional(hint: Any) -> bool:
    return hint is object or type(None) in typing.get_args(hint)


def _typed(source: str, key: str, value: Any, hint: Any) -> Any:
    optional = type(None) in typing.get_args(hint)
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    if base is object or (value is None and optional):
        return value
    ok = (
        (base is bool and isinstance(value, bool))
        or (base is int and isinstance(value, int) and not isinstance(value, bool))
        or (base is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (base is str and isinstance(value, str))
    )
    if not ok:
        nullable = " or null" if optional else ""
        raise ConfigValueError(
            f"{source}: {key}: expected {_NAMES[base]}{nullable}, got {value!r} "
            f"({type(value).__name__})"
        )
    if base is float and not math.isfinite(value):
        raise ConfigValueError(f"{source}: {key}: must be a finite number, got {value}")
    return float(value) if base is float else value


def check_positive(obj: object, keys: tuple[str, ...], *, nullable: bool = False) -> None:
    """Raise :class:`ScheduleError` naming the first of ``keys`` whose value on ``obj`` is
    below 1 (``None`` passes where ``nullable``)."""
    for key in keys:
        value = getattr(obj, key)
        if (value is not None or not nullable) and value < 1:
            raise ScheduleError(f"{key}: must be >= 1{' or null' * nullable}, got {value}")
