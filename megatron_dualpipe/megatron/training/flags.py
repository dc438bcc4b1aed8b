"""Megatron-LM's command-line flags for the training config, generated from the field
definitions of :class:`~.config.TrainConfig` (:func:`~.config.config_keys`): each key gets
Megatron-LM's spelling, its one-line documentation as help, and, for a true/false key, the
opposite flag as well (so that a flag can undo a ``--yaml-cfg`` value). A flag of Megatron-LM
that the config does not have is refused by name. Imports neither torch nor megatron.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any

from .config import ConfigKey, config_keys, parse_overrides
from .megatron_lm_flags import MEGATRON_LM_FLAGS, MEGATRON_LM_TAG

__all__ = ["add_config_flags", "flag_values", "parse_flags", "unknown_flag_problem"]

_DEST = "config."  # flag destinations are "config.<key>", apart from the parser's own


def add_config_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Add one flag (two for a true/false key) per config key to ``parser``; returns every
    option string added."""
    group = parser.add_argument_group(
        "config keys",
        f"Megatron-LM's flags (as at {MEGATRON_LM_TAG}); each sets the config key in\n"
        "brackets and overrides the --yaml-cfg file's value.",
    )
    added: list[str] = []
    for key in config_keys():
        if key.type is bool:
            added += _add_switches(group, key)
        else:
            choices = "{" + ",".join(key.choices or ()) + "}"
            metavar = choices if key.choices else key.type.__name__.upper()
            group.add_argument(
                *key.flags, dest=_DEST + key.name, metavar=metavar, help=_help(key, key.doc)
            )
            added += key.flags
    return added


def _add_switches(group: argparse._ArgumentGroup, key: ConfigKey) -> list[str]:
    """Megatron-LM's switch for a true/false key (``--swiglu`` sets true,
    ``--disable-bias-linear`` or ``--no-...`` false) and its opposite."""
    sets, opposite = _switch(key)
    on, off = f"turn on: {key.doc}", f"turn off: {key.doc}"
    group.add_argument(
        *key.flags,
        dest=_DEST + key.name,
        action="store_const",
        const=sets,
        help=_help(key, on if sets else off),
    )
    group.add_argument(
        opposite,
        dest=_DEST + key.name,
        action="store_const",
        const=not sets,
        help=f"{off if sets else on} (undoes {key.flags[0]}; megatron-dualpipe's flag)",
    )
    return [*key.flags, opposite]


def _switch(key: ConfigKey) -> tuple[bool, str]:
    """What Megatron-LM's switch of a true/false key sets, and the opposite flag's spelling."""
    sets = not key.flags[0].startswith(("--no-", "--disable-"))
    return sets, "--no-" + key.flags[0][2:] if sets else "--" + key.name.replace("_", "-")


def _help(key: ConfigKey, doc: str) -> str:
    if key.required:
        default = "; required, here or in --yaml-cfg"
    elif key.type is bool:
        default = f"; default: {'on' if key.default else 'off'}"
    elif key.default is None:
        default = ""
    else:
        default = f"; default: {key.default}"
    own = "" if key.megatron_lm else " (megatron-dualpipe's key)"
    return f"{doc}{default}{own} [{key.name}]".replace("%", "%%")


def flag_values(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The config values the flags in ``args`` set, typed as the keys' types, and where each
    came from (``--num-layers 8``) for error messages; ConfigError names a bad flag."""
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for key in config_keys():
        value = getattr(args, _DEST + key.name, None)
        if value is None:
            continue
        if key.type is bool:
            sets, opposite = _switch(key)
            values[key.name] = value
            origins[key.name] = key.flags[0] if value == sets else opposite
        else:
            origins[key.name] = f"{key.flags[0]} {value}"
            values.update(parse_overrides([f"{key.name}={value}"], source=key.flags[0]))
    return values, origins


def unknown_flag_problem(words: Sequence[str], known: Sequence[str]) -> str:
    """One sentence about the first of ``words`` a parser did not take: a Megatron-LM flag
    that is not a config key, or a misspelling of one of ``known``."""
    word = next((w for w in words if w.startswith("-")), words[0])
    name = word.split("=")[0]
    if name in MEGATRON_LM_FLAGS:
        return (
            f"{name} is a Megatron-LM flag this script does not support (megatron-dualpipe's "
            "training config has no such key): remove it; --help lists the flags it takes"
        )
    close = [k for k in known if k.startswith(name)] or difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unrecognized argument: {word}{hint}"


def parse_flags(
    parser: argparse.ArgumentParser, known: Sequence[str], argv: Sequence[str] | None
) -> argparse.Namespace:
    """``parser.parse_known_args(argv)``; anything left over ends the program with
    :func:`unknown_flag_problem`'s sentence (exit status 2, as argparse's errors)."""
    args, rest = parser.parse_known_args(argv)
    if rest:
        parser.exit(2, f"{parser.prog}: error: {unknown_flag_problem(rest, known)}\n")
    return args
