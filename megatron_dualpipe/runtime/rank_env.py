"""Which rank of a job this process is, when torchrun or srun started it.

torchrun sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; srun ``SLURM_PROCID``,
``SLURM_NTASKS`` and ``SLURM_LOCALID``, with ``MASTER_ADDR`` and ``MASTER_PORT`` exported by
the batch script. :func:`launcher_env` reads either into a :class:`RankEnv` (None when
neither started this process), and :meth:`RankEnv.torchrun_variables` gives the variables
``torch.distributed``'s ``env://`` rendezvous (and Megatron-LM) read. A malformed variable
is one sentence (:class:`LauncherEnvError`), before any process-group work. Standard
library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import DualPipeError

__all__ = ["LauncherEnvError", "RankEnv", "launcher_env"]


class LauncherEnvError(DualPipeError, ValueError):
    """A launcher's variable is missing or malformed; the message names it."""


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str

    def torchrun_variables(self) -> dict[str, str]:
        """The variables torchrun would set for this rank."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def launcher_env() -> RankEnv | None:
    """The rank set by torchrun or srun, or None when neither started this process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        keys, launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK"), "torchrun"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        keys, launcher = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"), "srun"
    else:
        return None
    rank, world, local = (_whole_number(k, env.get(k, "0"), launcher) for k in keys)
    if not 0 <= rank < world:
        raise LauncherEnvError(
            f"{launcher} environment with {keys[0]}={rank} and {keys[1]}={world}: the rank must "
            f"be between 0 and {keys[1]} - 1"
        )
    addr = _required("MASTER_ADDR", launcher)
    port = _whole_number("MASTER_PORT", _required("MASTER_PORT", launcher), launcher)
    return RankEnv(rank, world, local, addr, port, launcher)


def _required(name: str, launcher: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise LauncherEnvError(
            f"{launcher} environment without {name}: export MASTER_ADDR and MASTER_PORT "
            "(the rank-0 host and a free port) before starting the ranks"
        )
    return value


def _whole_number(name: str, value: str, launcher: str) -> int:
    if not value.strip().isdigit():
        raise LauncherEnvError(
            f"{launcher} environment with {name}={value!r}: expected a whole number (unset "
            "RANK and WORLD_SIZE, or SLURM_PROCID and SLURM_NTASKS, to let train fork the ranks "
            "itself)"
        )
    return int(value)
