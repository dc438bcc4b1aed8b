"""The pretraining loop behind ``megatron-dualpipe train``, on megatron-core (part of the
Megatron adapter layer: the only layer that imports megatron.core).

- :mod:`.config`: the YAML config, read and validated into a :class:`TrainConfig`
  (no torch or megatron import);
- :mod:`.flags`: Megatron-LM's command-line flags for the config's keys, generated from its
  field definitions (the pretrain script's parser); :mod:`.megatron_lm_flags`: the names
  of Megatron-LM's flags, to refuse the others by name;
- :mod:`.data`: deterministic synthetic token data by sample index;
- :mod:`.model`: this rank's model chunks under the schedule's placement, in DDP;
- :mod:`.optim`: Megatron's optimizer and learning-rate scheduler;
- :mod:`.loop`: one rank's run (train, evaluate, log, checkpoint, measure);
- :mod:`.checkpoint`: layout-agnostic dist_checkpointing checkpoints;
- :mod:`.measure`: one step's measured timeline beside the simulator's;
- :mod:`.report`: the printed lines;
- :mod:`.launch`: torchrun, srun or the embedded CPU launcher, and :func:`train`;
- :mod:`.errors`: :class:`TrainError`, what a failed run raises.

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
