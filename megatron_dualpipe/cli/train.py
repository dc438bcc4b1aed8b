"""``megatron-dualpipe train`` (and ``train --dry-run``): a GPT pretrained on megatron-core
with a pipeline schedule. The loop is Megatron-LM's own ``pretrain()``
(:func:`~megatron_dualpipe.megatron.lm_launch.train_with_megatron_lm`; the dry run
:func:`~megatron_dualpipe.megatron.lm_dry_run.dry_run_with_megatron_lm`) wherever the
installed megatron-core ships the ``megatron/training`` it runs (:func:`default_loop`); on
older releases, or with ``--loop megatron-dualpipe``, this project's own loop
(:func:`~megatron_dualpipe.megatron.training.train`, and its ``dry_run`` module). Either dry
run's report is printed beside the memory model
(:mod:`megatron_dualpipe.planner.dry_run_report`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import DualPipeError
from .common import add_overrides, unwind_on_stop_signals

__all__ = ["LOOPS", "add", "default_loop", "run"]

#: What ``--profile`` sets: Megatron-LM's ``--profile --use-pytorch-profiler``.
_PROFILING = ("profile=true", "use_pytorch_profiler=true")
#: The training loops ``--loop`` chooses from.
LOOPS = ("megatron-lm", "megatron-dualpipe")


def default_loop() -> str:
    """``megatron-lm`` where the megatron-core installed is the release whose wheel's
    ``megatron/training`` Megatron-LM's loop runs (0.19), else ``megatron-dualpipe`` (whose
    import of the adapter refuses a megatron-core outside the supported range)."""
    from ..megatron.compat.version import route_training_installed  # imports no megatron

    return "megatron-lm" if route_training_installed() else "megatron-dualpipe"


def add(sub: argparse._SubParsersAction) -> None:
    try:
        from ..megatron.training.config import config_keys  # pure Python: no torch, no megatron
    except DualPipeError as err:  # an unsupported megatron-core: train says so when run
        keys = f"(not listed here: {err})"
    else:
        ours = ", ".join(key.name for key in config_keys() if not key.megatron_lm)
        theirs = ", ".join(key.name for key in config_keys() if key.megatron_lm)
        keys = f"megatron-dualpipe's own {ours}; Megatron-LM's arguments of those names {theirs}"
    p = sub.add_parser(
        "train",
        help="pretrain a GPT on megatron-core with a pipeline schedule",
        description="Train the model of a YAML config (keys mirror Megatron-LM's flags). "
        "Without torchrun or srun and without a GPU, forks world_size CPU ranks itself.",
        epilog=f"config keys (YAML or --set): {keys}",
    )
    p.add_argument("--config", type=Path, required=True, help="e.g. configs/tiny_gpt_cpu.yaml")
    add_overrides(p, "override a config key (repeatable), e.g. --set pipeline_schedule=1f1b")
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile with torch.profiler as Megatron-LM's --profile --use-pytorch-profiler "
        "(the steps after profile_step_start up to profile_step_end, on profile_ranks; set "
        "them with --set): one Chrome trace per profiled rank, a span per pipeline action, "
        "for simulate --profile (with --loop megatron-lm: Megatron-LM's profiler, the traces "
        "in <tensorboard_dir>/../torch_profile)",
    )
    p.add_argument(
        "--loop",
        choices=LOOPS,
        help="the training loop: megatron-lm, Megatron-LM's pretrain() from megatron-core "
        "0.19's wheel, patched for the run, the config's keys as its flags (a key is a flag "
        "in snake case, as Megatron-LM's args name it): the default where megatron-core 0.19 "
        "is installed (Python 3.12); or megatron-dualpipe, this project's own loop: the "
        "default on megatron-core 0.16 to 0.18",
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
    if (args.loop or default_loop()) == "megatron-lm":
        _megatron_lm(args)
        return
    if args.dry_run:
        _dry_run(args)
        return
    from ..megatron.training import ConfigError, load_config, train  # train imports torch
    from ..megatron.training.config import config_source

    if args.ranks is not None:
        raise ConfigError("--ranks chooses the ranks of a dry run: add --dry-run")
    overrides = [*(_PROFILING if args.profile else []), *args.overrides]
    with unwind_on_stop_signals():
        train(load_config(args.config, overrides), source=config_source(args.config, overrides))


def _megatron_lm(args: argparse.Namespace) -> None:
    from ..megatron.lm_args import MegatronLMConfigError

    if args.dry_run:
        from ..megatron.compat.known_warnings import silence_known_warnings
        from ..megatron.lm_dry_run import dry_run_with_megatron_lm  # imports torch when run

        silence_known_warnings()
        _print_dry_run(dry_run_with_megatron_lm(args.config, args.overrides, args.ranks))
        return
    if args.ranks is not None:
        raise MegatronLMConfigError("--ranks chooses the ranks of a dry run: add --dry-run")
    from ..megatron.lm_launch import train_with_megatron_lm  # imports torch when run

    overrides = [*(_PROFILING if args.profile else []), *args.overrides]
    with unwind_on_stop_signals():
        step = train_with_megatron_lm(args.config, overrides)
    if step is None:
        return
    from ..planner.measured_step import report_measured_step

    for line in report_measured_step(*step):
        print(line)


def _dry_run(args: argparse.Namespace) -> None:
    from ..megatron.compat.known_warnings import silence_known_warnings

    silence_known_warnings()
    from ..megatron.model.built import parse_ranks
    from ..megatron.training import load_config
    from ..megatron.training.config import config_source
    from ..megatron.training.dry_run import dry_run

    cfg = load_config(args.config, args.overrides)
    ranks = parse_ranks(args.ranks, cfg.pipeline_model_parallel_size)
    source = config_source(args.config, args.overrides)
    _print_dry_run(dry_run(cfg, ranks, source=source))


def _print_dry_run(result: Any) -> None:
    """The dry run's report (``megatron.model.built.DryRun``) beside the memory model."""
    from ..planner.dry_run_report import dry_run_lines, memory_of_ranks

    notes: list[str] = []
    memory = memory_of_ranks(result.values, notes)
    print("\n".join(dry_run_lines(result, memory, notes)))
