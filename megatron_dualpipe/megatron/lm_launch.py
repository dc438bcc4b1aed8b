"""A YAML config trained by Megatron-LM's own ``pretrain()``: what ``megatron-dualpipe train
--loop megatron-lm`` runs.

The config's keys become Megatron-LM's flags (:mod:`.lm_args`); the run is
:func:`~megatron_dualpipe.megatron.pretrain_gpt.main` (this project's ``pretrain_gpt.py``)
with the installed wheel's ``megatron/training`` patched for ``--pipeline-schedule`` (a copy
made for the run in a temporary folder of this process, which the next launch removes
where a ``kill -9`` left it: :func:`~.compat.lm_patch.make_patched_training`,
:func:`~..runtime.launch.process_tmpdir`).
Under torchrun or srun (:func:`~..runtime.rank_env.launcher_env`; srun's variables are
handed to Megatron-LM as torchrun's) this process is one rank; otherwise it forks the
config's ``world_size`` ranks on CPU over gloo (:func:`~..runtime.launch.run_ranks`: no
process outlives the command). On a machine without CUDA the flags of
:data:`CPU_FLAGS` come first (the config's own win); without a data path the run takes
Megatron's mock data, and ``max_position_embeddings`` defaults to ``seq_length``.

Everything that can be refused is refused before the first rank starts, in one sentence: a
key Megatron-LM has no argument for, a value its parser rejects, another megatron-core than
0.19, a checkpoint to load that is damaged or would run code
(:func:`~..megatron_lm.check_load`). What only validated arguments show (Megatron-LM's own
checks, our schedule's) each rank prints, and the command ends with one line per rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import DualPipeError
from ..runtime.rank_env import RankEnv
from ..schedules.config_values import override_origins, read_values
from .lm_args import MegatronLMConfigError, megatron_lm_argv, megatron_lm_parser

__all__ = ["CPU_FLAGS", "PretrainExit", "megatron_lm_run_argv", "train_with_megatron_lm"]

#: What Megatron-LM needs on CPU: its defaults are Transformer Engine, fused CUDA kernels
#: and NCCL.
CPU_FLAGS = (
    "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
    "--no-rope-fusion", "--distributed-backend", "gloo",
)  # fmt: skip
#: Keys that name training data; without any of them the run takes Megatron's mock data.
DATA_KEYS = ("data_path", "train_data_path", "per_split_data_args_path", "mock_data")


class PretrainExit(DualPipeError, RuntimeError):
    """Megatron-LM's ``pretrain`` (or our check inside it) exited with an error it printed."""


def megatron_lm_run_argv(
    settings: Mapping[str, Any], parser: argparse.ArgumentParser, source: str, *, on_cpu: bool
) -> list[str]:
    """Megatron-LM's command line for ``settings``: :data:`CPU_FLAGS` first ``on_cpu``, mock
    data without a data key, ``max_position_embeddings`` as ``seq_length`` where unset, then
    the config's flags; checked by Megatron-LM's parser (raises
    :class:`~.lm_args.MegatronLMConfigError` naming ``source``)."""
    defaults: list[str] = list(CPU_FLAGS) if on_cpu else []
    if not any(settings.get(key) for key in DATA_KEYS):
        defaults.append("--mock-data")
    if settings.get("max_position_embeddings") is None and settings.get("seq_length"):
        defaults += ["--max-position-embeddings", str(settings["seq_length"])]
    argv = [*defaults, *megatron_lm_argv(settings, parser, source)]
    try:
        parser.parse_args(argv)
    except argparse.ArgumentError as err:
        raise MegatronLMConfigError(
            f"{source}: {err}: give it a value Megatron-LM's parser takes"
        ) from None
    return argv


def train_with_megatron_lm(path: Path, overrides: Iterable[str]) -> None:
    """Train the config at ``path`` (with ``--set`` ``overrides``) with Megatron-LM's
    ``pretrain()``: here under torchrun or srun, else on the config's ``world_size`` forked
    CPU ranks. Raises :class:`~.lm_args.MegatronLMConfigError` (or, for the file itself,
    :class:`~..schedules.config_values.ConfigValueError`) before any rank starts."""
    import torch

    from ..runtime.launch import process_tmpdir
    from ..runtime.rank_env import launcher_env
    from .compat.lm_patch import make_patched_training
    from .compat.version import installed_megatron_core, megatron_lm_tag

    overrides = list(overrides)
    source, _ = override_origins(path, overrides)
    if megatron_lm_tag() != "core_v0.19.0":
        raise MegatronLMConfigError(
            f"Megatron-LM's loop runs the megatron/training of megatron-core 0.19, but "
            f"megatron-core {installed_megatron_core()} is installed: pip install "
            "'megatron-core==0.19.2' (Python 3.12), or train without --loop megatron-lm"
        )
    settings = read_values(path, overrides)
    env = launcher_env()
    on_cpu = not torch.cuda.is_available()
    folder = str(process_tmpdir())  # a kill -9 leaves it to the next launch to remove
    try:
        make_patched_training(Path(folder))
        sys.path.insert(0, folder)  # megatron.training is the copy from here on, ranks too
        try:
            _run(settings, source, env, on_cpu)
        finally:
            sys.path.remove(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run(settings: Mapping[str, Any], source: str, env: RankEnv | None, on_cpu: bool) -> None:
    """The run of :func:`train_with_megatron_lm`, the patched copy first on the path."""
    from ..lifetime import forks_die_with_forker
    from ..megatron_lm import check_load
    from ..runtime.launch import run_ranks
    from .compat.lm_patch import unpatched_training_problem

    problem = unpatched_training_problem()  # the first import of megatron.training
    if problem is not None:
        raise MegatronLMConfigError(problem)
    parser = megatron_lm_parser()
    argv = megatron_lm_run_argv(settings, parser, source, on_cpu=on_cpu)
    check_load(parser.parse_args(argv))  # each rank checks again in apply()
    if env is not None:  # torchrun's or srun's rank: Megatron-LM reads torchrun's variables
        os.environ.update(env.torchrun_variables())
        forks_die_with_forker()  # a save's writers die with the rank (forked ranks: done)
        _pretrain(argv)
        return
    world_size = int(settings.get("world_size") or _model_parallel_size(settings))
    minutes = float(settings.get("distributed_timeout_minutes") or 10)
    run_ranks(
        _rank,
        world_size,
        args=(argv,),
        timeout_s=None,
        pg_timeout_s=60 * minutes,
        plain_errors=(PretrainExit,),
    )


def _model_parallel_size(settings: Mapping[str, Any]) -> int:
    """TP x PP x CP of ``settings``: the fewest ranks the config runs on."""
    size = 1
    for key in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"
    ):  # fmt: skip
        size *= int(settings.get(key) or 1)
    return size


def _rank(rank: int, world_size: int, argv: list[str]) -> None:
    """One forked rank: Megatron-LM's ``pretrain()`` (the default process group is up)."""
    _pretrain(argv)


def _pretrain(argv: list[str]) -> None:
    """``pretrain_gpt.main(argv)``; Megatron-LM's ``--exit-interval`` exit (code 0) ends it
    as a finished run, another exit is :class:`PretrainExit` (its error printed already)."""
    from .pretrain_gpt import main

    try:
        main(argv)
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise PretrainExit(
                f"Megatron-LM's pretrain exited with code {stop.code} (its error is above)"
            ) from None
