"""The pretraining loop behind ``megatron-dualpipe train``, on megatron-core (part of the
Megatron adapter layer: the only layer that imports megatron.core).

- :mod:`.config`: the YAML config, read and validated into a :class:`TrainConfig`
  (no torch or megatron import);
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

import warnings
from typing import TYPE_CHECKING

from .config import ConfigError, TrainConfig, load_config
from .errors import TrainError

if TYPE_CHECKING:
    from .loop import TrainResult

__all__ = ["ConfigError", "TrainConfig", "TrainError", "load_config", "train"]


#: Warnings of megatron-core 0.16.1 and torch 2.13 that say nothing about the run:
#: optional fused kernels absent, deprecations inside their own code.
_KNOWN_WARNINGS = (
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed"),
    (UserWarning, r"full scope is deprecated"),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),
    (FutureWarning, r"Please use DTensor instead"),
    (FutureWarning, r"`load_state_dict` is deprecated"),
)


def train(cfg: TrainConfig, *, source: str = "config") -> TrainResult:
    """Run ``cfg`` (see :func:`.launch.train`); silences :data:`_KNOWN_WARNINGS`."""
    for category, message in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    from .launch import train as _train

    return _train(cfg, source=source)
