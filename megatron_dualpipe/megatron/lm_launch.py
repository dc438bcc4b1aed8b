"""A YAML config trained by Megatron-LM's own ``pretrain()``: what ``megatron-dualpipe train``
runs.

The config's keys become Megatron-LM's flags (:mod:`.lm_args`); the run is
:func:`~megatron_dualpipe.megatron.pretrain_gpt.main` with the wheel's ``megatron/training``
patched for ``--pipeline-schedule`` (:func:`~.compat.lm_patch.make_patched_training`, in
:func:`~..runtime.launch.process_tmpdir`). Under torchrun or srun
(:func:`~..runtime.rank_env.launcher_env`) this process is one rank; otherwise it forks the
config's ``world_size`` ranks on CPU over gloo (:func:`~..runtime.launch.run_ranks`). On a
machine without CUDA the keys of :data:`CPU_SETTINGS` are added. Everything that can be
refused is refused before the first rank starts, in one sentence (:func:`check_folders`,
:func:`_check_data_files`, :func:`~..megatron_lm.check_load`). What it runs and refuses:
docs/training.md, "Where the ranks come from".
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DualPipeError
from ..schedules.config_values import override_origins, read_values
from .lm_args import MegatronLMConfigError, megatron_lm_argv, megatron_lm_parser

if TYPE_CHECKING:  # both import torch: this module imports neither torch nor megatron
    from ..megatron_lm import MeasuredStep
    from ..runtime.rank_env import RankEnv

__all__ = [
    "CPU_SETTINGS",
    "DATA_KEYS",
    "WRITTEN_FOLDERS",
    "PretrainExit",
    "check_folders",
    "checked_run_argv",
    "megatron_lm_run_argv",
    "model_parallel_size",
    "patched_training",
    "read_config",
    "train_with_megatron_lm",
]

#: What Megatron-LM needs on CPU, as config keys (its defaults are Transformer Engine,
#: fused CUDA kernels and NCCL): ``--transformer-impl local``, ``--no-persist-layer-norm``,
#: ``--no-gradient-accumulation-fusion``, ``--no-{bias-gelu,bias-dropout,masked-softmax,
#: rope}-fusion``, ``--distributed-backend gloo``. A key the config sets wins.
CPU_SETTINGS: dict[str, Any] = {
    "transformer_impl": "local",
    "no_persist_layer_norm": True,
    "gradient_accumulation_fusion": False,
    "bias_gelu_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "distributed_backend": "gloo",
}
#: Keys that name training data (Megatron-LM 0.19's data arguments); without any of them,
#: and without ``mock_data`` given, the run takes Megatron's mock data.
DATA_KEYS = (
    "data_path", "train_data_path", "valid_data_path", "test_data_path",
    "per_split_data_args_path", "data_args_path", "mock_data",
)  # fmt: skip


class PretrainExit(DualPipeError, RuntimeError):
    """Megatron-LM's ``pretrain`` (or our check inside it) exited with an error it printed."""


def megatron_lm_run_argv(
    settings: Mapping[str, Any], parser: argparse.ArgumentParser, source: str, *, on_cpu: bool
) -> tuple[list[str], argparse.Namespace]:
    """Megatron-LM's command line for ``settings`` over :data:`CPU_SETTINGS` (``on_cpu``),
    with mock data where no :data:`DATA_KEYS` key is given and ``max_position_embeddings``
    as ``seq_length`` where unset, and what Megatron-LM's parser makes of it (raises
    :class:`~.lm_args.MegatronLMConfigError` naming ``source`` where it refuses it)."""
    given = {**(CPU_SETTINGS if on_cpu else {}), **settings}
    if not any(key in settings for key in DATA_KEYS):
        given["mock_data"] = True
    if settings.get("max_position_embeddings") is None and settings.get("seq_length"):
        given["max_position_embeddings"] = settings["seq_length"]
    argv = megatron_lm_argv(given, parser, source)
    try:  # every flag is one of the parser's with its values (lists only where it takes them)
        parsed = parser.parse_args(argv)
    except argparse.ArgumentError as err:
        raise MegatronLMConfigError(
            f"{source}: {err}: give it a value Megatron-LM's parser takes"
        ) from None
    return argv, parsed


def read_config(path: Path, overrides: Iterable[str]) -> tuple[dict[str, Any], str]:
    """The config at ``path`` with ``--set`` ``overrides``: its keys and values, and where
    they come from (``path with --set ...``, for the refusals). A file that does not read
    is a :class:`~..schedules.config_values.ConfigValueError`; nothing imports torch."""
    overrides = list(overrides)
    source, _ = override_origins(path, overrides)
    return read_values(path, overrides), source


def train_with_megatron_lm(settings: Mapping[str, Any], source: str) -> MeasuredStep | None:
    """Train a config's ``settings`` (:func:`read_config`, from ``source``) with Megatron-LM's
    ``pretrain()``: here under torchrun or srun, else on the config's ``world_size`` forked
    CPU ranks. Returns, in the process of global rank 0 (or the one that forked the ranks),
    the step ``pipeline_timeline`` measured, else None. Raises
    :class:`~.lm_args.MegatronLMConfigError` before any rank starts."""
    warning = set_cuda_device_max_connections(settings)  # before anything asks CUDA
    with patched_training():
        import torch

        from ..runtime.rank_env import launcher_env

        on_cpu = not torch.cuda.is_available()
        if warning is not None and not on_cpu:
            logging.getLogger(__name__).warning(warning)
        return _run(settings, source, launcher_env(), on_cpu)


@contextlib.contextmanager
def patched_training() -> Iterator[None]:
    """Within the block, ``megatron.training`` is megatron-core 0.19's patched for
    ``--pipeline-schedule`` (a copy made for the block in a temporary folder of this
    process, first on ``sys.path``; a ``kill -9`` leaves it to the next launch to remove).
    Another megatron-core is refused in one sentence."""
    from ..runtime.launch import process_tmpdir
    from .compat.lm_patch import make_patched_training, unpatched_training_problem
    from .compat.version import (
        installed_megatron_core,
        megatron_lm_tag,
        route_training_installed,
    )

    if not route_training_installed():
        raise MegatronLMConfigError(
            f"train runs Megatron-LM's pretrain() from the megatron/training of megatron-core "
            f"0.19's wheel, but megatron-core {installed_megatron_core()} is installed: on "
            "Python 3.12, pip install 'megatron-core==0.19.2'; with this release, apply "
            f"patches/megatron-lm-{megatron_lm_tag()}.patch to a Megatron-LM checkout at "
            f"{megatron_lm_tag()} and run its pretrain_gpt.py with --pipeline-schedule"
        )
    with process_tmpdir() as patched:
        folder = str(patched)
        make_patched_training(patched)
        sys.path.insert(0, folder)  # megatron.training is the copy from here on, ranks too
        try:
            problem = unpatched_training_problem()  # the first import of megatron.training
            if problem is not None:
                raise MegatronLMConfigError(problem)
            yield
        finally:
            sys.path.remove(folder)


def _run(
    settings: Mapping[str, Any], source: str, env: RankEnv | None, on_cpu: bool
) -> MeasuredStep | None:
    """The run of :func:`train_with_megatron_lm`, the patched copy first on the path."""
    from ..lifetime import forks_die_with_forker
    from ..runtime.launch import run_ranks

    argv, parsed = checked_run_argv(settings, source, on_cpu=on_cpu)
    queue = _saves_torch_dist_here(parsed)
    holder = env is None or env.rank == 0
    with _one_run_per_save(parsed, holder=holder):
        if env is not None:  # torchrun's or srun's rank: Megatron-LM reads torchrun's variables
            os.environ.update(env.torchrun_variables())
            forks_die_with_forker()  # a save's forked writers die with the rank (not
            # --use-persistent-ckpt-worker's: Megatron-LM spawns it; forked ranks: done)
            measured = _pretrain(argv, queue)
        else:
            _import_what_every_rank_imports()
            world_size = int(settings.get("world_size") or model_parallel_size(settings))
            minutes = float(settings.get("distributed_timeout_minutes") or 10)
            measured = run_ranks(
                _rank,
                world_size,
                args=(argv, queue),
                timeout_s=None,
                pg_timeout_s=60 * minutes,
                plain_errors=(PretrainExit,),
                failure_as=lambda failure: PretrainExit(failure.cause),
            )[0]
    return measured if holder else None


def _import_what_every_rank_imports() -> None:
    """Import here, once, what each forked rank would import for itself: Megatron-Core's text
    tokenizers (``build_tokenizer`` loads them by name; their Hugging Face library imports
    ``transformers``, about 2 s per rank on CPU)."""
    import megatron.core.tokenizers.text  # noqa: F401


def checked_run_argv(
    settings: Mapping[str, Any], source: str, *, on_cpu: bool
) -> tuple[list[str], argparse.Namespace]:
    """:func:`megatron_lm_run_argv` of ``settings`` with Megatron-LM's parser, and every
    check ``train`` runs on it before any rank starts (our flags without a schedule, the
    checkpoint to load, intervals, profile, folders, data files); raises
    :class:`~.lm_args.MegatronLMConfigError`, one sentence naming ``source``. Call it
    within :func:`patched_training`."""
    from ..megatron_lm import check_load, unscheduled_flag

    argv, parsed = megatron_lm_run_argv(settings, megatron_lm_parser(), source, on_cpu=on_cpu)
    unscheduled = unscheduled_flag(parsed)  # apply() would say it in each rank
    if unscheduled is not None:
        raise MegatronLMConfigError(
            f"{source}: {unscheduled[0]} {unscheduled[1]}: give that schedule with "
            "pipeline_schedule"
        )
    check_load(parsed)  # each rank checks again in apply()
    _check_intervals(parsed, source)
    _check_profile(parsed, source, on_cpu=on_cpu)
    if on_cpu:
        _check_cuda_only(parsed, source)
    _check_async_save(parsed, source, on_cpu=on_cpu)
    check_folders(parsed, source)
    _check_data_files(parsed, source)
    return argv, parsed


def set_cuda_device_max_connections(settings: Mapping[str, Any]) -> str | None:
    """``CUDA_DEVICE_MAX_CONNECTIONS`` for this process and the ranks, where the launching
    shell left it unset, by the rule Megatron-LM's ``validate_args`` asserts (1 with tensor
    or context parallelism before Blackwell, not 1 with the MoE all-to-all overlap, FSDP or
    UCC): set from the config's values before anything here asks CUDA (the driver reads it
    when CUDA starts). A value set against the rule is kept; returns the one-sentence
    warning that says so (on GPUs; CPU ranks have no queues, and :func:`check_max_connections`
    refuses what Megatron-LM asserts), else None. Sizes that are not whole numbers set
    nothing: Megatron-LM's parser refuses them next."""
    from .schedule.checks import cuda_device_max_connections

    try:
        tensor_parallel = int(settings.get("tensor_model_parallel_size") or 1)
        context_parallel = int(settings.get("context_parallel_size") or 1)
    except (TypeError, ValueError):
        return None
    value, warning = cuda_device_max_connections(
        tensor_parallel=tensor_parallel,
        context_parallel=context_parallel,
        overlap=bool(settings.get("overlap_moe_expert_parallel_comm")),
        current=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        more_than_one=bool(
            settings.get("use_torch_fsdp2")
            or settings.get("use_megatron_fsdp")
            or settings.get("pipeline_model_parallel_comm_backend") == "ucc"
        ),
    )
    if value is not None:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = value
    return warning


def check_max_connections(parsed: argparse.Namespace, source: str) -> None:
    """On CPU ranks: an exported ``CUDA_DEVICE_MAX_CONNECTIONS`` that Megatron-LM's
    ``validate_args`` asserts against (not 1 with tensor or context parallelism, where
    neither the all-to-all overlap nor FSDP is on, for which it only warns; this project's
    CPU view reports a Hopper) is one sentence, not an assertion on every rank."""
    exported = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    tensor_parallel = getattr(parsed, "tensor_model_parallel_size", 1)
    model_parallel = tensor_parallel > 1 or getattr(parsed, "context_parallel_size", 1) > 1
    warned_only = any(
        getattr(parsed, key, False)
        for key in ("overlap_moe_expert_parallel_comm", "use_torch_fsdp2", "use_megatron_fsdp")
    )
    if model_parallel and not warned_only and exported not in (None, "1"):
        raise MegatronLMConfigError(
            f"{source}: CUDA_DEVICE_MAX_CONNECTIONS={exported} is exported, and Megatron-LM "
            "requires 1 with tensor or context parallelism (validate_args asserts it on every "
            "rank): unset it, or export CUDA_DEVICE_MAX_CONNECTIONS=1"
        )


def _on_disk(path: str) -> bool:
    """Whether ``path`` is a file system's, not object storage's (``s3://``, ``msc://``:
    Megatron-Core's ``is_object_storage_path``), which these checks leave to Megatron."""
    from megatron.core.datasets.object_storage_utils import is_object_storage_path

    return not is_object_storage_path(str(path))


#: The folders Megatron-LM writes to during a run (checkpoints, dataset index caches,
#: TensorBoard's events), by argument.
WRITTEN_FOLDERS = ("save", "data_cache_path", "tensorboard_dir")


def check_folders(parsed: argparse.Namespace, source: str) -> None:
    """Each folder of :data:`WRITTEN_FOLDERS` the run names, and the folder of
    ``--pipeline-timeline``'s picture, can be written by this process (made where missing;
    :func:`~..writable.unwritable`), else one sentence naming it:
    Megatron-LM finds an unwritable ``--save`` at its first save, after the iterations
    before it. Checked on the machine of the process that starts the ranks (under torchrun
    or srun each process checks its own)."""
    from ..writable import unwritable

    for key in WRITTEN_FOLDERS:
        folder = getattr(parsed, key, None)
        why = unwritable(folder) if folder and _on_disk(folder) else None
        if why is not None:
            raise MegatronLMConfigError(
                f"{source}: {key}: cannot write to {folder} ({why}): set {key} to a folder "
                "this user can write to"
            )
    picture = getattr(parsed, "pipeline_timeline", None)
    why = unwritable(Path(picture).parent) if picture else None
    if why is not None:
        raise MegatronLMConfigError(
            f"{source}: pipeline_timeline: cannot write to {Path(picture).parent} ({why}): set "
            "pipeline_timeline to a file in a folder this user can write to"
        )


def _check_intervals(parsed: argparse.Namespace, source: str) -> None:
    """The intervals Megatron-LM 0.19 needs, which its ``validate_args`` and ``pretrain()``
    check with a bare AssertionError, a TypeError or a ZeroDivisionError on every rank:
    ``save_interval`` above 0 with ``save`` (and a ``save_retain_interval`` that is a
    multiple of it), and ``eval_interval`` above 0, by which ``pretrain()`` divides the
    iterations to size the validation data (``get_train_valid_test_num_samples``; a run that
    validates fully or skips training does not, unless it resumes:
    ``build_train_valid_test_data_loaders`` does)."""
    save_interval = parsed.save_interval or 0
    if parsed.save is not None and not save_interval > 0:
        raise MegatronLMConfigError(
            f"{source}: save is set and save_interval is {parsed.save_interval}, and "
            "Megatron-LM's pretrain() saves every save_interval iterations (its validate_args "
            "asserts one above 0): set save_interval, e.g. to train_iters (it also saves at "
            "the end and at exit_interval)"
        )
    retain = parsed.save_retain_interval
    if parsed.save is not None and retain is not None and (retain <= 0 or retain % save_interval):
        raise MegatronLMConfigError(
            f"{source}: save_retain_interval {retain} is not a positive multiple of "
            f"save_interval {save_interval} (Megatron-LM's validate_args asserts it): make it one"
        )
    exempt = (parsed.full_validation or parsed.skip_train) and parsed.load is None
    if not (parsed.eval_interval or 0) > 0 and not exempt:
        raise MegatronLMConfigError(
            f"{source}: eval_interval is {parsed.eval_interval}, and Megatron-LM's pretrain() "
            "divides the training iterations by it to size the validation data (an error on "
            "every rank): set eval_interval above 0, e.g. to train_iters (eval_iters: 0 "
            "validates nothing)"
        )


#: Megatron-LM switches that need what CPU ranks have not, and what (each failed on CPU
#: ranks, in a traceback or an error, or each rank refused it, before it was refused here).
CUDA_ONLY = {
    "moe_grouped_gemm": "grouped-GEMM kernels (validate_args asks the GPU's capability)",
    "moe_permute_fusion": "Transformer Engine's fused permutation",
    "tp_comm_overlap": "Transformer Engine's userbuffers",
    "use_torch_fsdp2": "torch's fully_shard over CUDA devices",
    "use_megatron_fsdp": "Megatron-FSDP's CUDA buffers",
    "enable_cuda_graph": "CUDA graphs (Megatron-LM reads it as cuda_graph_impl local)",
    "external_cuda_graph": "CUDA graphs (Megatron-LM reads it as cuda_graph_impl "
    "transformer_engine)",
}


def _check_cuda_only(parsed: argparse.Namespace, source: str) -> None:
    """On CPU ranks: a switch of :data:`CUDA_ONLY` on, the ``flex`` token dispatcher
    (DeepEP's or HybridEP's GPU kernels), sequence parallelism over TP > 1 (Megatron-Core's
    local norms refuse it), ``log_memory_to_tensorboard`` where a TensorBoard writer logs
    (``torch.cuda.memory_stats()``), a ``cuda_graph_impl`` but ``none`` (each rank refused
    it after starting) or what :func:`check_max_connections` refuses is one sentence before
    any rank."""
    tensor_parallel = getattr(parsed, "tensor_model_parallel_size", 1)
    if getattr(parsed, "sequence_parallel", False) and tensor_parallel > 1:
        raise MegatronLMConfigError(
            f"{source}: sequence_parallel needs Transformer Engine's or Apex's norms "
            "(Megatron-Core's local ones refuse it), which CPU ranks cannot run: set "
            "sequence_parallel: false here"
        )
    needing = dict(CUDA_ONLY)
    if getattr(parsed, "tensorboard_dir", None):  # only a TensorBoard writer reads them
        needing["log_memory_to_tensorboard"] = "CUDA's memory statistics (torch.cuda.memory_stats)"
    for key, needs in needing.items():
        if getattr(parsed, key, False):
            raise MegatronLMConfigError(
                f"{source}: {key} needs {needs}, which CPU ranks have not: set {key}: false here"
            )
    check_max_connections(parsed, source)
    impl = getattr(parsed, "cuda_graph_impl", None) or "none"
    if impl != "none":
        raise MegatronLMConfigError(
            f"{source}: cuda_graph_impl {impl} captures CUDA graphs, which CPU ranks cannot: "
            "set cuda_graph_impl: none here"
        )
    if getattr(parsed, "moe_token_dispatcher_type", None) == "flex":
        raise MegatronLMConfigError(
            f"{source}: moe_token_dispatcher_type flex needs DeepEP's or HybridEP's GPU "
            "kernels, which CPU ranks have not: use alltoall or allgather here"
        )


#: The checkpoint formats Megatron-LM 0.19's ``save_checkpoint`` saves asynchronously.
ASYNC_SAVE_FORMATS = ("torch_dist", "torch_dcp", "fsdp_dtensor")


def _check_async_save(parsed: argparse.Namespace, source: str, *, on_cpu: bool) -> None:
    """``--async-save`` where Megatron-LM 0.19 keeps it on (``validate_args`` turns it off
    for a distributed format without ``--use-persistent-ckpt-worker``, and the rank saves):
    the legacy format ``torch``, which ``save_checkpoint`` cannot save so (it raises at the
    first save, on every rank); the persistent worker, which ``initialize_megatron``
    starts, on CPU ranks (it selects a CUDA device first, ``PersistentAsyncCaller.
    async_loop``, dies, and the first save waits on it for ever); the worker under
    ``--async-strategy nvrx``, Megatron-LM's default, without nvidia-resiliency-ext
    (Megatron-Core's ``has_nvrx_async_support``: a traceback on every rank)."""
    persistent = getattr(parsed, "use_persistent_ckpt_worker", False)
    form = getattr(parsed, "ckpt_format", "torch_dist")
    if not getattr(parsed, "async_save", False) or (form != "torch" and not persistent):
        return
    if form not in ASYNC_SAVE_FORMATS and getattr(parsed, "save", None) is not None:
        raise MegatronLMConfigError(
            f"{source}: async_save cannot save ckpt_format {form} (Megatron-LM's "
            "save_checkpoint refuses it at the first save, on every rank): set ckpt_format "
            f"to one of {', '.join(ASYNC_SAVE_FORMATS)}, or async_save: false"
        )
    if not persistent:
        return
    if on_cpu:
        raise MegatronLMConfigError(
            f"{source}: async_save with use_persistent_ckpt_worker cannot run on CPU ranks: "
            "Megatron-Core's persistent checkpoint worker selects a CUDA device as it starts, "
            "fails without one, and the ranks would wait on it for ever: set async_save: "
            "false here (saves are then synchronous)"
        )
    if getattr(parsed, "async_strategy", "nvrx") == "nvrx":
        from megatron.core.dist_checkpointing.strategies.nvrx import has_nvrx_async_support

        if not has_nvrx_async_support():
            raise MegatronLMConfigError(
                f"{source}: async_save with async_strategy nvrx (Megatron-LM's default) needs "
                "nvidia-resiliency-ext's asynchronous checkpointing, which is not installed: "
                "pip install nvidia-resiliency-ext, or set async_strategy: mcore"
            )


def _check_profile(parsed: argparse.Namespace, source: str, *, on_cpu: bool) -> None:
    """Megatron-LM's ``--profile``: its steps in order and within the run (it stops the
    profiler at iteration ``profile_step_end`` only; ``torch.profiler.schedule`` refuses an
    empty window when ``train()`` starts); with ``--use-pytorch-profiler`` each profiled
    rank's Chrome trace goes into ``<tensorboard_dir>/../torch_profile`` (``train``'s
    trace handler), so a ``--tensorboard-dir``; without it ``train_step`` starts CUDA's
    profiler for nsys (``cudaProfilerStart``), which CPU ranks have not."""
    if not parsed.profile:
        return
    start, end = parsed.profile_step_start, parsed.profile_step_end
    if end <= start:  # torch.profiler.schedule refuses active <= 0 when train() starts
        raise MegatronLMConfigError(
            f"{source}: profile_step_end {end} is not after profile_step_start {start}: "
            "profile the steps after profile_step_start up to profile_step_end (e.g. 2 and 3)"
        )
    if parsed.train_iters is not None and parsed.train_iters < end:
        raise MegatronLMConfigError(
            f"{source}: profile_step_end {end} is past train_iters {parsed.train_iters}, and "
            "Megatron-LM stops the profiler (and writes its trace) at that iteration only: "
            "lower profile_step_end or raise train_iters"
        )
    if on_cpu and not parsed.use_pytorch_profiler:
        raise MegatronLMConfigError(
            f"{source}: profile without use_pytorch_profiler starts CUDA's profiler for nsys, "
            "which CPU ranks have not (every rank failed at profile_step_start): set "
            "use_pytorch_profiler: true and a tensorboard_dir, beside which its traces go"
        )
    if parsed.use_pytorch_profiler and not parsed.tensorboard_dir:
        raise MegatronLMConfigError(
            f"{source}: profile with use_pytorch_profiler writes its traces into "
            "<tensorboard_dir>/../torch_profile (Megatron-LM's place for them), and "
            "tensorboard_dir is not set (they would go to ./torch_profile beside an empty "
            "folder named None): set tensorboard_dir, e.g. runs/tensorboard"
        )


#: Megatron-LM 0.19's split where ``--data-path`` is given without one (``validate_args``).
_LEGACY_SPLIT = "969, 30, 1"


def _check_data_files(parsed: argparse.Namespace, source: str) -> None:
    """The datasets Megatron-LM will read, as its ``get_blend_and_blend_per_split`` finds
    them (``--data-path`` or the ``--data-args-path`` file, split by ``--split``; the
    per-split paths or their JSON file, whole), checked against each other
    (:func:`~.data.file_checks.data_file_problem`), token ids against the tokenizer's
    vocabulary (:func:`_vocabulary`); nothing with ``--mock-data``. What Megatron-LM refuses
    itself (both a path and its file) is left to it."""
    from megatron.training.utils import get_blend_and_blend_per_split

    from .data.file_checks import data_file_problem

    if getattr(parsed, "mock_data", False):
        return
    try:
        blend, per_split = get_blend_and_blend_per_split(parsed)
    except AssertionError:
        return  # Megatron-LM's validate_args says what it refuses
    except OSError as err:
        raise MegatronLMConfigError(
            f"{source}: {err.filename} cannot be read ({err.strerror}): name the file of data "
            "paths that Megatron-LM is to read"
        ) from None
    except (ValueError, KeyError, TypeError) as err:  # not JSON (an object), no paths
        given = (
            f"per_split_data_args_path: {parsed.per_split_data_args_path} is"
            if parsed.per_split_data_args_path
            else "the data paths are"
        )
        raise MegatronLMConfigError(
            f"{source}: {given} not what Megatron-LM reads ({type(err).__name__}: {err}): "
            "give data paths, or weights and paths by turns (per_split_data_args_path: a "
            'JSON object with "train", "valid" and "test", each a list of them)'
        ) from None
    blend_key = "data_args_path" if parsed.data_args_path else "data_path"
    split_keys = ("train_data_path", "valid_data_path", "test_data_path")
    if parsed.per_split_data_args_path:
        split_keys = ("per_split_data_args_path",) * 3
    whole = [
        (key, prefix)
        for key, found in zip(split_keys, per_split or (None,) * 3, strict=True)
        if found is not None
        for prefix in found[0]
        if _on_disk(prefix)
    ]
    split = parsed.split or (_LEGACY_SPLIT if parsed.data_path is not None else None)
    if blend is not None and split is None:  # GPTDatasetConfig asserts it in every rank
        raise MegatronLMConfigError(
            f"{source}: data_args_path's blend needs a split (Megatron-LM gives data_path "
            "one, not data_args_path): set split, such as 969,30,1"
        )
    prefixes = [p for p in blend[0] if _on_disk(p)] if blend is not None else []
    vocabulary, tokenizer = _vocabulary(parsed)
    try:
        problem = data_file_problem(
            [(blend_key, p) for p in prefixes],
            whole,
            split=split,
            vocabulary=vocabulary,
            tokenizer=tokenizer,
            validation_off="set eval_iters: 0" if parsed.eval_iters else None,
            weighted=blend is None or blend[1] is not None,
            seq_length=parsed.seq_length,
        )
    except (ValueError, AssertionError, ZeroDivisionError):  # Megatron-Core's split parser
        raise MegatronLMConfigError(
            f"{source}: split: {split!r} is not a split Megatron-Core reads: give up to three "
            "weights for train, valid and test, at least one above 0, such as 969,30,1"
        ) from None
    if problem is not None:
        raise MegatronLMConfigError(f"{source}: {problem[1]}")
    _check_default_cache(parsed, source, [*prefixes, *(prefix for _, prefix in whole)])


def _check_default_cache(parsed: argparse.Namespace, source: str, prefixes: list[str]) -> None:
    """Without ``--data-cache-path`` Megatron-Core's GPTDataset writes each dataset's index
    caches into ``<prefix>/cache/GPTDataset_indices``, beside the data (``GPTDataset.
    _build_document_sample_shuffle_indices``; their names hash the sample counts, so a run
    of other iterations writes new ones), and rank 0 fails there, after the model is
    built, where it cannot: each such folder of the checked datasets is tried first."""
    from ..writable import unwritable

    if parsed.data_cache_path is not None:
        return
    for prefix in prefixes:
        folder = Path(prefix) / "cache" / "GPTDataset_indices"
        why = unwritable(folder)
        if why is not None:
            raise MegatronLMConfigError(
                f"{source}: data_cache_path is not set, so Megatron-Core writes the dataset "
                f"index caches of {prefix} into {folder}, which cannot be written ({why}): "
                "set data_cache_path to a folder this user can write to"
            )


def _vocabulary(parsed: argparse.Namespace) -> tuple[int | None, str]:
    """The number of ids of the tokenizer the ranks will build (Megatron-Core's
    ``build_tokenizer`` on a copy of the arguments, the vocabulary not padded; the route's
    default NullTokenizer where none is named) and its name; None where it does not build
    here (each rank then fails on it with Megatron-Core's own error), where it would run
    the tokenizer's own code (``trust_remote_code``) or where a file it names is not on disk
    (a Hugging Face hub name, which the ranks download)."""
    given = argparse.Namespace(**vars(parsed))
    given.tokenizer_type = given.tokenizer_type or "NullTokenizer"
    given.pad_vocab_size = False
    files = [getattr(given, k, None) for k in ("tokenizer_model", "vocab_file", "merge_file")]
    if getattr(given, "trust_remote_code", False) or any(
        f is not None and not Path(f).exists() for f in files
    ):  # the launcher runs no code of a tokenizer, nor downloads one: the ranks do
        return None, given.tokenizer_type
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    try:
        return build_tokenizer(given).vocab_size, given.tokenizer_type
    except Exception:  # noqa: BLE001 - whatever it raises, the ranks raise it again and say so
        return None, given.tokenizer_type


@contextlib.contextmanager
def _one_run_per_save(parsed: argparse.Namespace, *, holder: bool) -> Iterator[None]:
    """Megatron-LM's ``--save`` held for the block by the ``holder`` (this command where it
    forks the ranks, which inherit the lock; global rank 0 under torchrun or srun):
    :func:`~.checkpoint.lock.save_lock`, and a folder of another run's complete checkpoints
    that this run does not ``--load`` refused (:func:`~.checkpoint.files.check_fresh_save`),
    one sentence before any rank starts. The other ranks hold nothing: where rank 0
    refuses, their launcher stops them (torchrun, ``srun --kill-on-bad-exit``)."""
    from .checkpoint.files import check_fresh_save
    from .checkpoint.lock import save_lock

    save = getattr(parsed, "save", None)
    if save is None or not holder or not _on_disk(save):
        yield
        return
    with save_lock(save):
        check_fresh_save(save, getattr(parsed, "load", None))
        yield


def model_parallel_size(settings: Mapping[str, Any]) -> int:
    """TP x PP x CP of ``settings``: the fewest ranks the config runs on."""
    size = 1
    for key in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"
    ):  # fmt: skip
        size *= int(settings.get(key) or 1)
    return size


def _rank(rank: int, world_size: int, argv: list[str], queue: bool) -> MeasuredStep | None:
    """One forked rank: Megatron-LM's ``pretrain()`` (the default process group is up);
    rank 0 returns the measured step, if any."""
    return _pretrain(argv, queue)


def _pretrain(argv: list[str], queue: bool) -> MeasuredStep | None:
    """``pretrain_gpt.main(argv)`` and what it returns (where the rank saves ``torch_dist``
    checkpoints itself, ``queue``, the checkpoint writer's queue made to die with the rank
    first: :func:`~.checkpoint.writer_queue.writer_queue_dies_with_rank`); Megatron-LM's
    ``--exit-interval`` exit (code 0) ends it as a finished run (nothing measured
    returned), another exit is :class:`PretrainExit` (its error printed already)."""
    from .pretrain_gpt import main

    if queue:  # its first save spawns a manager: made to die with us
        from .checkpoint.writer_queue import writer_queue_dies_with_rank

        writer_queue_dies_with_rank()
    try:
        return main(argv)
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise PretrainExit(_exit_said(stop.code)) from None
        return None


def _saves_torch_dist_here(parsed: argparse.Namespace) -> bool:
    """Whether the run (Megatron-LM's parsed arguments) saves ``torch_dist`` checkpoints from
    the rank itself: ``--save``, ``--ckpt-format torch_dist`` (its default), and not
    ``--async-save``'s worker, which keeps a queue of its own (Megatron-LM 0.19's
    ``validate_args`` turns ``--async-save`` off without ``--use-persistent-ckpt-worker``:
    the rank saves then)."""
    asynchronous = getattr(parsed, "async_save", False) and getattr(
        parsed, "use_persistent_ckpt_worker", False
    )
    return (
        getattr(parsed, "save", None) is not None
        and getattr(parsed, "ckpt_format", "torch_dist") == "torch_dist"
        and not asynchronous
    )


def _exit_said(code: object) -> str:
    """What Megatron-LM's ``pretrain`` exiting with ``code`` means: its result validation's
    two codes (``megatron.core.rerun_state_machine``) in words, any other by number."""
    from megatron.core import rerun_state_machine as rerun

    validation = (
        "Megatron-LM's result validation (check_for_nan_in_loss_and_grad, rerun_mode "
        "validate_results)"
    )
    if code == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE:
        return (
            f"{validation} stopped the run with exit code {code} (the lines above say why: a "
            "NaN or another unexpected value that a rerun in place reproduced, or a resumed "
            "rerun on the same device), for it to be resumed from its checkpoint on other "
            "hardware, which tells a device's fault from the model's; on this machine such a "
            "resume stops the same way: if the run diverges, lower lr or clip_grad, and set "
            "rerun_mode: disabled to resume from that checkpoint here (a NaN then stops the "
            "run on the rank that saw it)"
        )
    if code == rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION:
        return (
            f"{validation} finished its diagnosis of an unexpected value and stopped the run "
            f"(exit code {code}); the lines above say which it was: a transient fault (the "
            "rerun did not reproduce it), a persistent fault of a device, or a correct result "
            "(the model itself diverged: lower lr or clip_grad)"
        )
    return f"Megatron-LM's pretrain exited with code {code} (its error is above)"
