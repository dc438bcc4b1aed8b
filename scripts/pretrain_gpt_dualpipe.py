#!/usr/bin/env python
"""Pretrain a GPT (or GPT-MoE) on megatron-core with Megatron-LM's flags.

    python scripts/pretrain_gpt_dualpipe.py --pipeline-schedule dualpipev \\
        --pipeline-model-parallel-size 2 --num-layers 8 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 \\
        --micro-batch-size 2 --global-batch-size 16 --train-iters 20 --lr 3e-3 \\
        --vocab-size 128
    python scripts/pretrain_gpt_dualpipe.py --yaml-cfg configs/tiny_gpt_cpu.yaml \\
        --pipeline-schedule 1f1b

Every key of a megatron-dualpipe config is a flag, spelled as Megatron-LM spells it; flags
override the --yaml-cfg file's keys. Under torchrun or srun it uses their ranks; alone on a
machine without a GPU it forks --world-size CPU ranks (default: the parallel sizes' product).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dualpipe.megatron.training import ConfigError, TrainError, train  # noqa: E402
from megatron_dualpipe.megatron.training.config import (  # noqa: E402
    TrainConfig,
    config_from_values,
    read_yaml_values,
)
from megatron_dualpipe.megatron.training.config.flags import (  # noqa: E402
    add_config_flags,
    flag_values,
    parse_flags,
)

SCRIPT = "pretrain_gpt_dualpipe.py"


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    """The script's parser (Megatron-LM's conventions: no abbreviations) and its flags."""
    parser = argparse.ArgumentParser(
        prog=SCRIPT,
        usage="%(prog)s [-h] [--yaml-cfg PATH] [--FLAG VALUE ...] [--SWITCH ...]",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--yaml-cfg",
        type=Path,
        metavar="PATH",
        help="a megatron-dualpipe YAML config (keys in snake_case; e.g. configs/tiny_gpt_cpu.yaml)",
    )
    return parser, ["--help", "--yaml-cfg", *add_config_flags(parser)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser, known = build_parser()
    return parse_flags(parser, known, argv)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The validated TrainConfig of ``args`` (flags over the YAML file's keys)."""
    values = {} if args.yaml_cfg is None else read_yaml_values(args.yaml_cfg)
    flagged, origins = flag_values(args)
    values.update(flagged)
    source = str(args.yaml_cfg) if args.yaml_cfg else SCRIPT
    stem = args.yaml_cfg.stem if args.yaml_cfg else Path(SCRIPT).stem
    return config_from_values(values, source, stem, origins)


def main(argv: list[str] | None = None) -> int:
    try:
        train(config_from_args(parse_args(argv)), source=SCRIPT)
    except KeyboardInterrupt:
        print(f"{SCRIPT}: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, TrainError) as err:
        print(f"{SCRIPT}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
