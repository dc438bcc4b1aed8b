"""A YAML config's keys as Megatron-LM's command line.

A config's key is a Megatron-LM argument's name as ``args`` holds it (the flag in snake
case: ``num_layers`` for ``--num-layers``); :func:`megatron_lm_argv` turns the keys into the
flags of Megatron-LM's own parser (``megatron.training.arguments.add_megatron_arguments``,
with our ``--pipeline-schedule``), so every key, type and default is Megatron-LM's: ``true``
and ``false`` pick the flag that stores that value (``bias_gelu_fusion: false`` is
``--no-bias-gelu-fusion``, ``no_persist_layer_norm: true`` is ``--no-persist-layer-norm``), a
list gives a flag of several values its values, ``null`` leaves Megatron-LM's default.
:data:`LAUNCHER_KEYS` are the launcher's, not Megatron-LM's.

Importing this module imports neither torch nor megatron: :func:`megatron_lm_parser` does.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Mapping
from typing import Any

from ..errors import DualPipeError

__all__ = [
    "LAUNCHER_KEYS",
    "NAMED_OTHERWISE",
    "OTHER_WAY",
    "MegatronLMConfigError",
    "megatron_lm_argv",
    "megatron_lm_parser",
]

#: Keys the launcher takes for itself: how many CPU ranks to fork without torchrun or srun.
LAUNCHER_KEYS = ("world_size",)
#: Keys a config may hold that Megatron-LM's parser (0.19) takes under another name: the
#: value ``args`` ends up holding (``validate_args`` derives it), a deprecated flag, and the
#: ``schedule_file`` of this project's former loop (``--pipeline-schedule-file``). A refusal
#: names the argument to write instead.
NAMED_OTHERWISE = {
    "virtual_pipeline_model_parallel_size": "num_virtual_stages_per_pipeline_rank",
    "cuda_graph_scope": "cuda_graph_modules",
    "schedule_file": "pipeline_schedule_file",
}


#: Keys of this project's former loop that Megatron-LM's loop does another way, and how.
OTHER_WAY = {
    "optimize_schedule": (
        "Megatron-LM's loop keeps the schedule optimiser (the planner) out of the training "
        "run: profile a run (--profile), optimise its order on the trace (megatron-dualpipe "
        "simulate --profile TRACE --schedule S --pp P --microbatches M --optimize --save "
        "ORDER) and train it with pipeline_schedule_file: ORDER"
    ),
}


class MegatronLMConfigError(DualPipeError, ValueError):
    """A config key or value that Megatron-LM's arguments cannot take; the message says
    which, and what to write instead."""


def megatron_lm_parser() -> argparse.ArgumentParser:
    """Megatron-LM's argument parser (``megatron.training``'s, as ``parse_args`` builds it)
    with ``--pipeline-schedule``."""
    from megatron.training.arguments import add_megatron_arguments

    from ..megatron_lm import add_arguments

    parser = argparse.ArgumentParser(prog="pretrain", allow_abbrev=False, exit_on_error=False)
    return add_arguments(add_megatron_arguments(parser))


def megatron_lm_argv(
    settings: Mapping[str, Any], parser: argparse.ArgumentParser, source: str
) -> list[str]:
    """The flags that give Megatron-LM's ``args`` the values of ``settings`` (a config's keys
    and values, :data:`LAUNCHER_KEYS` left out); raises :class:`MegatronLMConfigError`
    naming ``source`` for a key that is no argument of ``parser`` or a value it cannot hold."""
    actions: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:  # argparse lists its actions nowhere public
        if action.option_strings:
            actions.setdefault(action.dest, []).append(action)
    argv: list[str] = []
    for key, value in settings.items():
        if key in LAUNCHER_KEYS or value is None or (key in OTHER_WAY and not value):
            continue
        if key in OTHER_WAY:
            raise MegatronLMConfigError(f"{source}: {key}: {OTHER_WAY[key]}")
        if key not in actions:
            close = difflib.get_close_matches(key, actions, n=1, cutoff=0.75)
            if key in NAMED_OTHERWISE and NAMED_OTHERWISE[key] in actions:
                close = [NAMED_OTHERWISE[key]]
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise MegatronLMConfigError(
                f"{source}: {key} is not an argument of Megatron-LM's pretrain{hint}: write a "
                "Megatron-LM flag in snake case, or remove it"
            )
        argv += _flags(key, value, actions[key], source)
    return argv


def _flags(key: str, value: Any, actions: list[argparse.Action], source: str) -> list[str]:
    """The flags (and values) that set argument ``key`` to ``value``."""
    if isinstance(value, bool):
        for action in actions:
            if isinstance(action, argparse.BooleanOptionalAction):
                positive, negative = action.option_strings[:2]
                return [positive if value else negative]
            if action.nargs == 0 and action.const is value:  # store_true, store_false
                return [_long_flag(action)]
        if all(action.default is value for action in actions):
            return []  # Megatron-LM's default already, and no flag to write it
        raise MegatronLMConfigError(
            f"{source}: {key}: {str(value).lower()} is not a value Megatron-LM's flags give "
            f"it (they are {', '.join(_long_flag(a) for a in actions)}): change or remove it"
        )
    stores = [a for a in actions if a.nargs != 0]
    if not stores:
        raise MegatronLMConfigError(
            f"{source}: {key} is a switch of Megatron-LM ({_long_flag(actions[0])}): write "
            "true or false"
        )
    many = isinstance(value, list | tuple)
    if many and stores[0].nargs in (None, "?"):
        raise MegatronLMConfigError(
            f"{source}: {key} takes one value ({_long_flag(stores[0])}), not a list: write "
            'the list as one string, as on Megatron-LM\'s command line (e.g. "[1,0,1]")'
        )
    return [_long_flag(stores[0]), *(str(v) for v in (value if many else [value]))]


def _long_flag(action: argparse.Action) -> str:
    """The action's first ``--`` flag (Megatron-LM's own spelling comes first)."""
    return next(s for s in action.option_strings if s.startswith("--"))
