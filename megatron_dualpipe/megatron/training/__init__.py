"""The pretraining loop behind ``megatron-dualpipe train``, on megatron-core (part of the
Megatron adapter layer: the only layer that imports megatron.core).

Its rooms, each a package: :mod:`.config` (the YAML config read and checked into a
:class:`TrainConfig`; no torch or megatron import), :mod:`.data` (samples, datasets,
tokenizers, preprocess) and :mod:`.checkpoint` (dist_checkpointing saves and loads, the
files on disk). The modules beside them are the run itself: :mod:`.launch` (torchrun, srun
or the embedded CPU launcher, and :func:`train`), :mod:`.loop` (one rank's run),
:mod:`.model`, :mod:`.optim`, :mod:`.finite`, :mod:`.report`,
:mod:`.profiling`, :mod:`.tensorboard`, :mod:`.schedule_order` and :mod:`.dry_run`; and a
leaf every room may import: :mod:`.errors` (:class:`TrainError`).

Importing this package imports neither torch nor megatron; :func:`train` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..compat.known_warnings import silence_known_warnings
from .config import ConfigError, TrainConfig, load_config
from .errors import TrainError

if TYPE_CHECKING:
    from .loop import TrainResult

__all__ = ["ConfigError", "TrainConfig", "TrainError", "load_config", "train"]


def train(cfg: TrainConfig, *, source: str = "config") -> TrainResult:
    """Run ``cfg`` (see :func:`.launch.train`), hiding megatron-core's known warnings
    (:func:`~..known_warnings.silence_known_warnings`)."""
    silence_known_warnings()
    from .launch import train as _train

    return _train(cfg, source=source)
