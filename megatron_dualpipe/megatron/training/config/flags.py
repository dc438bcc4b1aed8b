"""Megatron-LM's command-line flags for the training config, generated from the field
definitions of :class:`~.config.TrainConfig` (:func:`~.config.config_keys`): each key gets
Megatron-LM's spelling, its one-line documentation as help, and, for a true/false key, the
opposite flag as well (so that a flag can undo a ``--yaml-cfg`` value). A flag of Megatron-LM
that the config does not have is refused by name. Imports neither torch nor megatron.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import Any

from .keys import ConfigKey, config_keys
from .megatron_lm_flags import MEGATRON_LM_FLAGS, MEGATRON_LM_TAG, NO_OP_FLAGS
from .reading import parse_overrides

__all__ = ["add_config_flags", "flag_values", "no_op_note", "parse_flags", "unknown_flag_problem"]

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


def _named(flags: Sequence[str], one: str, many: str) -> str:
    return f"{', '.join(flags)} {one if len(flags) == 1 else many}"


def unknown_flag_problem(words: Sequence[str], known: Sequence[str]) -> str:
    """One sentence naming every flag of ``words`` a parser did not take (a pasted
    Megatron-LM launch line is refused once, not flag by flag): the Megatron-LM flags that
    are not config keys, then the misspellings of ``known`` (each with its closest match)."""
    flags = list(dict.fromkeys(w.split("=")[0] for w in words if w.startswith("--")))
    flags = flags or [words[0]]
    megatrons = [f for f in flags if f in MEGATRON_LM_FLAGS]
    others = [f for f in flags if f not in MEGATRON_LM_FLAGS]
    hinted = [_with_close_match(name, known) for name in others]
    unknown = f"unrecognized argument{'s' if len(hinted) > 1 else ''}: {', '.join(hinted)}"
    if not megatrons:
        return unknown
    sentence = _named(
        megatrons,
        "is a Megatron-LM flag this script does not support (megatron-dualpipe's training "
        "config has no such key)",
        "are Megatron-LM flags this script does not support (megatron-dualpipe's training "
        "config has no such keys)",
    )
    if others:
        sentence += f", and {unknown}"
    them = "it" if len(flags) == 1 else "them"
    return f"{sentence}: remove {them}; --help lists the flags it takes"


def _with_close_match(name: str, known: Sequence[str]) -> str:
    close = [k for k in known if k.startswith(name)] or difflib.get_close_matches(name, known, n=1)
    return f"{name} (did you mean {close[0]}?)" if close else name


def no_op_note(flags: Sequence[str]) -> str:
    """The one note for Megatron-LM flags that change nothing here (:data:`NO_OP_FLAGS`)."""
    reasons = "; ".join(dict.fromkeys(NO_OP_FLAGS[f] for f in flags))
    return f"{_named(flags, 'changes', 'change')} nothing here, ignored ({reasons})"


def parse_flags(
    parser: argparse.ArgumentParser, known: Sequence[str], argv: Sequence[str] | None
) -> argparse.Namespace:
    """``parser.parse_known_args(argv)``; anything left over ends the program with
    :func:`unknown_flag_problem`'s sentence (exit status 2, as argparse's errors), apart
    from :data:`NO_OP_FLAGS`, accepted with one note on stderr."""
    args, rest = parser.parse_known_args(argv)
    ignored = list(dict.fromkeys(w for w in rest if w in NO_OP_FLAGS))
    rest = [w for w in rest if w not in NO_OP_FLAGS]
    if rest:
        parser.exit(2, f"{parser.prog}: error: {unknown_flag_problem(rest, known)}\n")
    if ignored:
        print(f"{parser.prog}: note: {no_op_note(ignored)}", file=sys.stderr)
    return args
