"""Stand-in for ``megatron-dualpipe train`` in the Slurm launcher tests.

Run by ``scripts/slurm/pretrain_*.sbatch`` through ``TRAIN_CMD="python tests/data/slurm_probe.py"``
with the trainer's arguments (``--config PATH [--set key=value ...]``). It reads its rank the
way the trainer does (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, MASTER_ADDR / MASTER_PORT),
checks the configuration first (an unknown ``pipeline_schedule`` fails with one sentence,
before any process-group work), then runs one gloo all_reduce over all tasks and prints one
line per rank.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta

import yaml

from megatron_dualpipe.schedules.registry import SCHEDULES

__all__ = ["main"]


def _config(path: str, overrides: list[str]) -> dict:
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --set takes key=value, got {item!r}")
        config[key] = yaml.safe_load(value)
    return config


def main(argv: list[str] | None = None) -> int:
    """Check the config, all_reduce once over every task, print this rank's line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    config = _config(args.config, args.set)
    schedule = config.get("pipeline_schedule")
    known = tuple(SCHEDULES)
    if schedule is not None and schedule not in known:
        print(
            f"error: unknown pipeline schedule {schedule!r}: choose one of {', '.join(known)}",
            file=sys.stderr,
        )
        return 2

    import torch
    import torch.distributed as dist

    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local = int(os.environ["SLURM_LOCALID"])
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    expected = world * (world + 1) / 2
    ok = total.item() == expected
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    print(
        f"probe: rank {rank}/{world} local {local} node {node} "
        f"all_reduce {'ok' if ok else 'WRONG'} ({total.item():g}, expected {expected:g}) "
        f"train_iters={config.get('train_iters')}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
