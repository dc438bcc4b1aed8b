"""``megatron-dualpipe patch-megatron-lm``: the installed wheel's megatron/training with
our patch applied; the work is
:func:`megatron_dualpipe.megatron.compat.lm_patch.make_patched_training`."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add", "run"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "patch-megatron-lm",
        help="make the patched megatron/training of the installed megatron-core wheel",
        description="Copy the megatron/training that the installed megatron-core wheel ships "
        "(0.17 and newer) to OUT/megatron/training and apply the megatron/training hunks of "
        "the patch of its Megatron-LM tag (patches/megatron-lm-<tag>.patch). With OUT first "
        "on PYTHONPATH, scripts/pretrain_gpt_megatron_lm.py runs Megatron-LM's pretrain() "
        "with --pipeline-schedule.",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("megatron-lm-patched"),
        metavar="DIR",
        help="where to write megatron/training (default: ./megatron-lm-patched)",
    )


def run(args: argparse.Namespace) -> None:
    from ..megatron.compat.lm_patch import make_patched_training  # reads files: imports no megatron

    training, patch = make_patched_training(args.out)
    out = args.out.resolve()
    print(
        f"wrote {training}, patched with {patch.name}; run Megatron-LM's loop with it first on "
        f"the path: PYTHONPATH={out} torchrun --nproc-per-node N "
        "scripts/pretrain_gpt_megatron_lm.py --pipeline-schedule dualpipev ..."
    )
