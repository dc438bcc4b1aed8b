"""``megatron-dualpipe train`` (and ``train --dry-run``): a GPT pretrained by Megatron-LM's
own ``pretrain()``, from the ``megatron/training`` that megatron-core 0.19's wheel ships,
patched for ``--pipeline-schedule``
(:func:`~megatron_dualpipe.megatron.lm_launch.train_with_megatron_lm`; the dry run
:func:`~megatron_dualpipe.megatron.lm_dry_run.dry_run_with_megatron_lm`, its report printed
beside the memory model by :mod:`megatron_dualpipe.planner.dry_run_report`). Another
megatron-core is refused in one sentence before any work."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .common import add_overrides, unwind_on_stop_signals

__all__ = ["add", "run"]

#: What ``--profile`` sets: Megatron-LM's ``--profile --use-pytorch-profiler``.
_PROFILING = ("profile=true", "use_pytorch_profiler=true")


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="pretrain a GPT on megatron-core with a pipeline schedule",
        description="Train the model of a YAML config (keys mirror Megatron-LM's flags). "
        "Without torchrun or srun and without a GPU, forks world_size CPU ranks itself.",
        epilog="config keys (YAML or --set): Megatron-LM's arguments in snake case, as its "
        "args name them (num_layers for --num-layers; true and false for its switches), "
        "megatron-dualpipe's own (pipeline_schedule, pipeline_schedule_file, "
        "pipeline_timeline, ...), and world_size for the CPU ranks train forks itself",
    )
    p.add_argument("--config", type=Path, required=True, help="e.g. configs/tiny_gpt_cpu.yaml")
    add_overrides(p, "override a config key (repeatable), e.g. --set pipeline_schedule=1f1b")
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile with torch.profiler as Megatron-LM's --profile --use-pytorch-profiler "
        "(the steps after profile_step_start up to profile_step_end, on profile_ranks; set "
        "them with --set): one Chrome trace per profiled rank, a span per pipeline action, "
        "for simulate --profile (Megatron-LM's profiler: the traces in "
        "<tensorboard_dir>/../torch_profile)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build the pipeline ranks' model chunks at full size on the meta device in a "
        "fake world of the config's size (nothing allocated, no GPU) and print per rank the "
        "layers, parameters beside the memory model, process groups and messages",
    )
    p.add_argument(
        "--ranks",
        metavar="R,...",
        help="with --dry-run: the pipeline ranks to build (default: every one)",
    )


def run(args: argparse.Namespace) -> None:
    from ..megatron.lm_args import MegatronLMConfigError
    from ..megatron.lm_launch import read_config, train_with_megatron_lm  # no torch yet

    if args.ranks is not None and not args.dry_run:
        raise MegatronLMConfigError("--ranks chooses the ranks of a dry run: add --dry-run")
    profiling = _PROFILING if args.profile and not args.dry_run else ()
    settings, source = read_config(args.config, [*profiling, *args.overrides])  # read once
    if args.dry_run:
        from ..megatron.compat.known_warnings import silence_known_warnings
        from ..megatron.lm_dry_run import dry_run_with_megatron_lm  # imports torch

        silence_known_warnings()
        _print_dry_run(dry_run_with_megatron_lm(settings, source, args.ranks))
        return
    with unwind_on_stop_signals():
        step = train_with_megatron_lm(settings, source)
    if step is None:
        return
    from ..planner.measured_step import report_measured_step

    for line in report_measured_step(*step):
        print(line)


def _print_dry_run(result: Any) -> None:
    """The dry run's report (``megatron.model.built.DryRun``) beside the memory model."""
    from ..planner.dry_run_report import dry_run_lines, memory_of_ranks

    notes: list[str] = []
    memory = memory_of_ranks(result.values, notes)
    print("\n".join(dry_run_lines(result, memory, notes)))
