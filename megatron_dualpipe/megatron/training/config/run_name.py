"""The name of a training run's own folder under ``output_dir``, so that runs which differ
keep their outputs apart: the config's name, the schedule, then each setting given on the
command line (``--set key=value``) that changes what is trained, in key order:

    tiny_moe_cpu-dualpipev
    tiny_moe_cpu-dualpipev-bf16=true-overlap_moe_expert_parallel_comm=true
    tiny_gpt_cpu-1f1b-train_iters=10

Settings that only say where things are read and written, how often the run logs,
evaluates, saves or stops, or how long a collective may wait (:data:`NOT_IN_NAMES`) leave
the name alone: a run stopped at ``exit_interval`` and resumed with ``load`` draws into one
folder. The same settings give the same name, so running a command again replaces its own
outputs.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["NOT_IN_NAMES", "run_name", "run_name_problem"]

#: Keys that do not change what a run trains (see the module docstring).
NOT_IN_NAMES = frozenset(
    {
        "pipeline_schedule",  # named already, second
        "output_dir",
        "run_name",
        "save",
        "load",
        "tensorboard_dir",
        "data_cache_path",
        "log_interval",
        "log_throughput",
        "log_memory_to_tensorboard",
        "tensorboard_log_interval",
        "eval_interval",
        "eval_iters",
        "save_interval",
        "exit_interval",
        "distributed_timeout_minutes",
        "profile",
        "profile_step_start",
        "profile_step_end",
        "profile_ranks",
        "use_pytorch_profiler",
    }
)
#: Longest suffix of settings spelled out; a longer one is a hash of the settings.
_LONGEST = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def run_name(stem: str, schedule: str, settings: Mapping[str, Any]) -> str:
    """``<stem>-<schedule>``, then ``-key=value`` per setting not in :data:`NOT_IN_NAMES`
    (sorted by key; characters other than letters, digits and ``._=+-`` as ``_``); where
    those would pass 100 characters, ``-`` and 8 hex digits of their SHA-1 instead."""
    named = sorted((k, _text(v)) for k, v in settings.items() if k not in NOT_IN_NAMES)
    suffix = "".join(f"-{key}={value}" for key, value in named)
    if len(suffix) > _LONGEST:
        digest = hashlib.sha1("\n".join(f"{k}={v}" for k, v in named).encode()).hexdigest()
        suffix = f"-{digest[:8]}"
    return _UNSAFE.sub("_", f"{stem}-{schedule}{suffix}")


def run_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a run's folder (one path component), or None."""
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        return f"must name one folder (no / or \\, not . or ..), got {name!r}"
    return None
