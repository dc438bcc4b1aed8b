#!/usr/bin/env python
"""Pretrain a GPT (or GPT-MoE) on megatron-core with Megatron-LM-style flags.

    python scripts/pretrain_gpt_dualpipe.py --pipeline-schedule dualpipev \\
        --pipeline-model-parallel-size 2 --num-layers 8 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 \\
        --global-batch-size 16 --train-iters 20 --lr 3e-3 --vocab-size 128
    python scripts/pretrain_gpt_dualpipe.py --yaml-cfg configs/tiny_gpt_cpu.yaml \\
        --pipeline-schedule 1f1b

Flags override the ``--yaml-cfg`` file's keys (the same names in snake_case). Under
torchrun or srun it uses their ranks; alone on a machine without a GPU it forks
``--world-size`` CPU ranks (default: the parallel sizes' product).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dualpipe.megatron.training import ConfigError, TrainError, train  # noqa: E402
from megatron_dualpipe.megatron.training.config import (  # noqa: E402
    config_from_values,
    parse_overrides,
    read_yaml_values,
)
from megatron_dualpipe.schedules.registry import SCHEDULES  # noqa: E402

#: Megatron-LM flags this script takes; each sets the config key of the same name.
FLAGS = (
    "tensor-model-parallel-size", "pipeline-model-parallel-size", "expert-model-parallel-size",
    "num-layers", "hidden-size", "num-attention-heads", "seq-length", "vocab-size",
    "micro-batch-size", "global-batch-size", "train-iters", "lr", "min-lr",
    "lr-warmup-iters", "lr-decay-style", "weight-decay", "clip-grad", "num-experts",
    "moe-router-topk", "save", "load", "save-interval", "eval-interval", "eval-iters",
    "log-interval", "seed", "world-size", "output-dir", "decoder-first-pipeline-num-layers",
    "decoder-last-pipeline-num-layers", "pipeline-model-parallel-layout", "mtp-num-layers",
    "ckpt-step", "schedule-file",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline-schedule", choices=list(SCHEDULES))
    parser.add_argument("--yaml-cfg", type=Path, help="a megatron-dualpipe YAML config")
    parser.add_argument("--use-distributed-optimizer", action="store_true", default=None)
    parser.add_argument("--overlap-grad-reduce", action="store_true", default=None)
    parser.add_argument("--bf16", action="store_true", default=None)
    parser.add_argument("--overlap-moe-expert-parallel-comm", action="store_true", default=None)
    parser.add_argument("--optimize-schedule", action="store_true", default=None)
    parser.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stop at the first NaN/Inf in the loss or gradients (default: on)",
    )
    parser.add_argument("--override-opt_param-scheduler", action="store_true", default=None,
                        dest="override_opt_param_scheduler")  # fmt: skip
    parser.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true", default=None,
                        dest="use_checkpoint_opt_param_scheduler")  # fmt: skip
    for flag in FLAGS:
        parser.add_argument(f"--{flag}", metavar="VALUE")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace):
    """The validated TrainConfig of ``args`` (flags over the YAML file's keys)."""
    values = {} if args.yaml_cfg is None else read_yaml_values(args.yaml_cfg)
    for key, value in vars(args).items():
        if value is not None and key != "yaml_cfg":
            flag = "--" + key.replace("_", "-")
            values.update(parse_overrides([f"{key}={value}"], source=flag))
    source = str(args.yaml_cfg) if args.yaml_cfg else "pretrain_gpt_dualpipe.py"
    return config_from_values(values, source, "runs/pretrain_gpt_dualpipe")


def main(argv: list[str] | None = None) -> int:
    try:
        train(config_from_args(parse_args(argv)), source="pretrain_gpt_dualpipe.py")
    except KeyboardInterrupt:
        print("pretrain_gpt_dualpipe.py: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, TrainError) as err:
        print(f"pretrain_gpt_dualpipe.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
