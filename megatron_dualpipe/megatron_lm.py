"""Megatron-LM's own training scripts with our schedules: ``--pipeline-schedule``.

``patches/megatron-lm-<tag>.patch`` (one per Megatron-LM tag, core_v0.16.1 to core_v0.19.0)
wires these hooks into Megatron-LM's ``pretrain_gpt.py`` and ``megatron/training``:
:func:`add_arguments` (the flags), :func:`apply` (the checks after Megatron's, before any
process group), :func:`forward_backward_func`, :func:`cuda_graph_helper`,
:func:`build_model_chunks`, :func:`prepare_model` and :func:`ddp_config` (``get_model``'s
chunks in our placements), :func:`embedding_ranks`, :func:`full_batch_on_this_rank` and
:func:`losses_on_last_stage`. What each does: docs/megatron-versions.md, "Megatron-LM's
patches".

Importing this module imports neither torch nor megatron; the hooks import them when called.
"""

from __future__ import annotations

import argparse
import logging
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from .megatron.schedule.checks import (
    DualPipeConfigError,
    check_run,
    overlap_problem,
    schedule_spec,
    stage_layers,
)
from .schedules.cuda_graphs import cuda_graph_problem, ep_overlap_graph_problem
from .schedules.ir import ScheduleError
from .schedules.layout import parse_layout
from .schedules.limits import train_size_problem
from .schedules.pipeline_setup import PipelineSetup
from .schedules.registry import OUR_SCHEDULES, SCHEDULES, ScheduleSpec
from .schedules.saved import read_saved_schedule, saved_schedule_problem

__all__ = [
    "PIPELINE_SCHEDULES",
    "add_arguments",
    "apply",
    "build_model_chunks",
    "builds_model_chunks",
    "check_load",
    "cuda_graph_helper",
    "ddp_config",
    "embedding_ranks",
    "float16_chunks",
    "forward_backward_func",
    "full_batch_on_this_rank",
    "losses_on_last_stage",
    "num_microbatches",
    "places_model_chunks",
    "prepare_model",
    "schedule_of_run",
]

logger = logging.getLogger(__name__)

#: Every value of ``--pipeline-schedule``.
PIPELINE_SCHEDULES = tuple(SCHEDULES)


@dataclass
class _Run:
    """What one Megatron-LM run resolved from its ``args``, once: the schedule's spec (None
    without ``--pipeline-schedule``), its :class:`PipelineSetup` (the split read at first
    need, after the checks), and its forward-backward function (None: Megatron's own,
    unwrapped; with ``--pipeline-timeline`` the measuring wrapper)."""

    args: Callable[[], Any]  # a weak reference to the run's args
    spec: ScheduleSpec | None
    setup: PipelineSetup | None = None
    func: Callable[..., Any] | None = None
    func_made: bool = False


#: Each Megatron-LM run by ``id(args)``, kept as long as its ``args`` live (a Namespace
#: compares by value, so it cannot key a weak dictionary).
_RUNS: dict[int, _Run] = {}
#: Our arguments that act on the run's schedule, with what they do (for the refusals).
_SCHEDULE_FLAGS = {
    "pipeline_schedule_file": "runs a saved order of the work",
    "pipeline_timeline": "measures a training step",
}


def _help() -> str:
    """``--pipeline-schedule``'s help, from the registry."""
    parts = [f"{s.name}: {s.summary} ({s.runner.value} runs it)" for s in SCHEDULES.values()]
    return (
        "pipeline-parallel schedule; "
        + "; ".join(parts)
        + ". Default: Megatron's own choice (1f1b, or interleaved-1f1b with a virtual pipeline)."
    )


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--pipeline-schedule`` and ``--pipeline-schedule-file`` in their own argument
    group; returns ``parser`` (Megatron's ``extra_args_provider`` contract)."""
    group = parser.add_argument_group(
        "megatron-dualpipe", "bidirectional and zero-bubble pipeline schedules"
    )
    group.add_argument(
        "--pipeline-schedule",
        choices=PIPELINE_SCHEDULES,
        default=None,
        metavar="{" + ",".join(PIPELINE_SCHEDULES) + "}",
        help=_help(),
    )
    group.add_argument(
        "--pipeline-schedule-file",
        default=None,
        metavar="FILE",
        help="run the order saved in FILE (simulate --optimize --save) of the work of "
        "--pipeline-schedule's schedule, one of megatron-dualpipe's; checked against the run "
        "before any work",
    )
    group.add_argument(
        "--pipeline-timeline",
        default=None,
        metavar="FILE",
        help="measure the second training step of --pipeline-schedule's schedule (one of "
        "megatron-dualpipe's) on every pipeline rank; at the end of the run global rank 0 "
        "prints each rank's measured and simulated bubble and draws the step, above the "
        "simulator's prediction, into FILE (a PNG; matplotlib needed)",
    )
    return parser


def _schedule(args: Any) -> str | None:
    return getattr(args, "pipeline_schedule", None)


def schedule_of_run(args: Any) -> ScheduleSpec:
    """The schedule the run takes: ``--pipeline-schedule``'s, else Megatron's own
    (interleaved 1F1B with virtual stages, else 1F1B)."""
    found = _spec(args)
    if found is not None:
        return found
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    return SCHEDULES["interleaved-1f1b" if vp else "1f1b"]


def num_microbatches(args: Any) -> int:
    """Micro-batches per step, from Megatron's validated arguments."""
    micro = args.micro_batch_size * getattr(args, "data_parallel_size", 1)
    return (args.global_batch_size or micro) // micro


#: Megatron-LM's split arguments, cleared in the config our placement builds from (Megatron's
#: TransformerConfig refuses them beside a layout; the layout carries the split).
_SPLIT_ARGS = {
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
}


def _run(args: Any) -> _Run:
    """This run's record, made (the schedule's name looked up) at its first call, and made
    again where ``args`` now name another schedule. ``args`` that cannot be referenced
    weakly (a ``SimpleNamespace``) get a record for the call only."""
    key, schedule = id(args), _schedule(args)
    run = _RUNS.get(key)
    named = None if run is None or run.spec is None else run.spec.name
    if run is not None and run.args() is args and named == schedule:
        return run
    found = None if schedule is None else schedule_spec(schedule)
    try:
        held = weakref.ref(args, lambda _: _RUNS.pop(key, None))
    except TypeError:
        return _Run(lambda: args, found)
    run = _RUNS[key] = _Run(held, found)
    return run


def _spec(args: Any) -> ScheduleSpec | None:
    """The spec of ``--pipeline-schedule`` (None without it)."""
    return _run(args).spec


def _setup(args: Any) -> PipelineSetup:
    """This run's pipeline, resolved once: for a schedule our runtime runs, with each model
    stage's layers from Megatron-LM's split arguments (:func:`_stage_layers`)."""
    run = _run(args)
    if run.setup is None:
        found, pp = run.spec, args.pipeline_model_parallel_size
        layers = _stage_layers(args, found) if found.runs_ours else ()
        run.setup = PipelineSetup(found, pp, layers)
    return run.setup


def _stage_layers(args: Any, found: ScheduleSpec) -> tuple[int, ...]:
    """Decoder layers per model stage from Megatron-LM's split arguments."""
    return stage_layers(
        found,
        args.pipeline_model_parallel_size,
        args.num_layers,
        first=getattr(args, "decoder_first_pipeline_num_layers", None),
        last=getattr(args, "decoder_last_pipeline_num_layers", None),
        account_for_embedding=getattr(args, "account_for_embedding_in_pipeline_split", False),
        account_for_loss=getattr(args, "account_for_loss_in_pipeline_split", False),
        layout=getattr(args, "pipeline_model_parallel_layout", None),
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
    )


def _check_cuda_graphs(args: Any, found: ScheduleSpec) -> None:
    """``--cuda-graph-impl`` and the graphed parts (``--cuda-graph-modules``, 0.16/0.17:
    ``--cuda-graph-scope``, read by :func:`~.megatron.compat.version.cuda_graph_setting`): a CUDA
    device for any graph, and what the schedule can graph
    (:func:`~.schedules.cuda_graphs.cuda_graph_problem`)."""
    from .megatron.compat.version import cuda_graph_setting

    impl, modules = cuda_graph_setting(args)
    if impl == "none":
        return
    shared = getattr(args, "moe_shared_expert_intermediate_size", None) is not None
    problem = cuda_graph_problem(
        found,
        impl,
        modules,
        shared_expert_in_router_graph=shared
        and not getattr(args, "moe_shared_expert_overlap", False),
    )
    if problem is not None:
        raise DualPipeConfigError(problem.replace("cuda_graph_impl ", "--cuda-graph-impl ", 1))
    ep_overlap = bool(getattr(args, "overlap_moe_expert_parallel_comm", False))
    problem = ep_overlap_graph_problem(found, impl, ep_overlap)
    if problem is not None:  # before the warm-up steps, not at the capture after them
        raise DualPipeConfigError(
            "--overlap-moe-expert-parallel-comm "
            + problem.replace("cuda_graph_impl: ", "--cuda-graph-impl ", 1)
        )
    if impl == "full_iteration" and getattr(args, "variable_seq_lengths", False):
        raise DualPipeConfigError(
            "--cuda-graph-impl full_iteration captures one step's shapes, and "
            "--variable-seq-lengths changes them every micro-batch: drop one of them"
        )
    import torch

    if not torch.cuda.is_available():
        raise DualPipeConfigError(
            f"--cuda-graph-impl {impl} captures CUDA graphs, and this machine has no CUDA "
            "device: drop --cuda-graph-impl (or set it to none)"
        )


def _take_layout(args: Any, found: ScheduleSpec) -> None:
    """A ``--pipeline-model-parallel-layout`` of a schedule that places its own chunks: one
    entry per model stage in pipeline order (dualpipev: the V's 2 x PP stages), read over
    our placement (:func:`_stage_layers`). Megatron-LM's ``validate_args`` read a layout of
    more stages than ranks as a virtual pipeline and set
    ``virtual_pipeline_model_parallel_size`` from it; ours is none (two chunks per rank by
    the placement), so it is unset again. Another number of stages is refused."""
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    schedule = found.name
    if layout is None or not found.places_chunks:
        return
    pp = args.pipeline_model_parallel_size
    try:
        stages = len(parse_layout(layout))
    except ScheduleError as err:
        raise DualPipeConfigError(f"--pipeline-model-parallel-layout: {err}") from None
    wanted = found.model_stages(pp)
    if stages != wanted:
        raise DualPipeConfigError(
            f"{schedule} runs {wanted} model stages on {pp} ranks and "
            f"--pipeline-model-parallel-layout has {stages}: give one entry per model stage, "
            "in pipeline order"
        )
    if wanted > pp:
        args.virtual_pipeline_model_parallel_size = None


def _check_step_size(args: Any, pp: int, chunks: int) -> None:
    """Refuse a step with more PP x micro-batches than a rank builds a schedule for (the
    bound ``simulate`` keeps: :func:`~.schedules.limits.train_size_problem`)."""
    microbatches = num_microbatches(args)
    too_large = train_size_problem(pp, microbatches, chunks)
    if too_large is not None:
        raise DualPipeConfigError(
            f"--global-batch-size {args.global_batch_size} makes {microbatches} micro-batches "
            "per step (--global-batch-size / (--micro-batch-size x data-parallel size)), and "
            f"{too_large}: lower --global-batch-size or raise --micro-batch-size"
        )


def _check(args: Any) -> None:
    found = _spec(args)
    schedule = found.name
    _check_cuda_graphs(args, found)
    _take_layout(args, found)
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    pp = args.pipeline_model_parallel_size
    if found.chunks == 1 and vp is not None and vp > 1:
        raise DualPipeConfigError(
            f"{schedule} runs one model chunk per rank: unset "
            "--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size, "
            "or choose interleaved-1f1b"
        )
    if found.chunks is None and (vp is None or vp < 2 or pp < found.min_ranks):
        raise DualPipeConfigError(
            f"{schedule} needs pipeline parallelism with two or more model chunks per rank: "
            "set --pipeline-model-parallel-size >= 2 and --num-layers-per-virtual-pipeline-stage"
        )
    saved = getattr(args, "pipeline_schedule_file", None)
    if saved is not None and not found.runs_ours:
        raise DualPipeConfigError(
            f"--pipeline-schedule-file runs a saved order of the work of the schedules "
            f"megatron-dualpipe runs ({', '.join(OUR_SCHEDULES)}), not Megatron's {schedule}: "
            "set --pipeline-schedule to one of them"
        )
    if getattr(args, "pipeline_timeline", None) is not None:
        from .megatron.compat.version import cuda_graph_setting

        if cuda_graph_setting(args)[0] == "full_iteration":
            raise DualPipeConfigError(
                "--pipeline-timeline measures a step's actions, and --cuda-graph-impl "
                "full_iteration replays the step as one graph: drop one of them"
            )
        if not found.runs_ours and getattr(args, "overlap_moe_expert_parallel_comm", False):
            raise DualPipeConfigError(
                f"--pipeline-timeline measures Megatron's {schedule} through its "
                "forward-compute and backward-compute timers, which its combined 1F1B "
                "(--overlap-moe-expert-parallel-comm) times as one: drop one of them"
            )
    if found.runs_ours or getattr(args, "pipeline_timeline", None) is not None:
        _check_step_size(args, pp, found.chunks_per_rank(vp))  # each rank builds the step
    if not found.runs_ours:
        return
    if getattr(args, "rampup_batch_size", None):
        raise DualPipeConfigError(
            f"{schedule} needs the same number of micro-batches every step: unset "
            "--rampup-batch-size"
        )
    check_run(
        found,
        pipeline_size=pp,
        num_microbatches=num_microbatches(args),
        virtual_pipeline_size=vp,
        context_parallel_size=getattr(args, "context_parallel_size", 1),
    )
    _setup(args)  # the split, checked
    if saved is not None:
        problem = saved_schedule_problem(saved, found, pp, num_microbatches(args))
        if problem is not None:
            raise DualPipeConfigError(f"--pipeline-schedule-file: {problem}")
    if found.places_chunks and getattr(args, "yaml_cfg", None) is not None:
        raise DualPipeConfigError(
            f"{schedule} builds its model config from command-line arguments: "
            "drop --yaml-cfg and pass the model settings as arguments"
        )
    fsdp = [f for f in ("use_megatron_fsdp", "use_torch_fsdp2") if getattr(args, f, False)]
    if found.placement == "mirror" and fsdp:
        raise DualPipeConfigError(
            f"{schedule} sums its two copies of every stage over Megatron DDP's gradient "
            f"buffers, which --{fsdp[0].replace('_', '-')} shards: drop it, or choose dualpipev"
        )
    if fsdp and found.splits_backward:
        raise DualPipeConfigError(
            f"{schedule} defers every weight gradient to its W through Megatron DDP's hooks "
            f"(delay_wgrad_compute), which --{fsdp[0].replace('_', '-')} does not take: drop "
            "it, or choose 1f1b"
        )
    if found.placement == "mirror" and getattr(args, "overlap_grad_reduce", False):
        _one_bucket_per_chunk(args, schedule)
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        problem = overlap_problem(
            found,
            expert_parallel=getattr(args, "expert_model_parallel_size", 1),
            dispatcher=getattr(args, "moe_token_dispatcher_type", "allgather"),
            half_precision=bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)),
            recompute_granularity=getattr(args, "recompute_granularity", None),
            mtp_num_layers=getattr(args, "mtp_num_layers", None),
            moe=bool(getattr(args, "num_experts", None)),
        )
        if problem is not None:
            raise DualPipeConfigError(f"--overlap-moe-expert-parallel-comm {problem}")


def _one_bucket_per_chunk(args: Any, schedule: str) -> None:
    """dualpipe sums its two copies of a stage after Megatron's data-parallel reduction, so
    both must be bucketed alike, and ``get_model`` buckets the first chunk only: ask it for
    one bucket per chunk (``--ddp-num-buckets 1`` makes a bucket as large as the rank's
    parameters); refuse a bucket size the user chose."""
    if getattr(args, "ddp_bucket_size", None) is not None or (
        getattr(args, "ddp_num_buckets", None) not in (None, 1)
    ):
        raise DualPipeConfigError(
            f"{schedule} with --overlap-grad-reduce needs one DDP bucket per model chunk (its "
            "two copies of a stage must be bucketed alike, and Megatron-LM buckets only the "
            "first chunk): drop --ddp-bucket-size / --ddp-num-buckets"
        )
    args.ddp_num_buckets = 1


def check_load(args: Any) -> None:
    """Read the ``torch_dist`` checkpoint that Megatron-LM's ``load_checkpoint`` will read
    (:func:`_load_directory`) without running code from it
    (:func:`~.megatron.checkpoint.files.damage`), where Megatron-LM's own reader
    unpickles its index with plain ``pickle`` (torch's ``FileSystemReader.read_metadata``)
    and its objects with ``weights_only=False``. A crafted pickle, a missing or truncated
    file is one sentence naming it and the complete iterations, before any work. Nothing
    is read where Megatron-LM loads nothing, a non-persistent checkpoint may win, or the
    folder is another format (no ``metadata.json``: Megatron-LM's ``torch`` and
    ``torch_dcp``, not checked). A ``--load`` that is a file, or that does not exist and is
    not also ``--save`` (a job's first run may save where later runs load), is refused:
    Megatron-LM would train from scratch."""
    from .megatron.checkpoint.files import missing_load

    problem = missing_load(
        getattr(args, "load", None),
        save=getattr(args, "save", None),
        pretrained=getattr(args, "pretrained_checkpoint", None),
        non_persistent=bool(getattr(args, "non_persistent_ckpt_type", None)),
    )
    if problem is not None:
        raise DualPipeConfigError(problem)
    found = _load_directory(args)
    if found is None or not (found[1] / "metadata.json").is_file():
        return
    flag, directory = found
    from .megatron.checkpoint.files import complete_iterations, damage

    problem = damage(directory)
    if problem is None:
        return
    root = directory.parent
    complete = complete_iterations(root)
    instead = (
        f"pass --ckpt-step with a complete one (iterations {', '.join(map(str, complete))})"
        if complete
        else f"there is no complete checkpoint in it: drop {flag} to train from scratch"
    )
    raise DualPipeConfigError(
        f"{flag} {root}: {directory.name} cannot be loaded, {problem}: {instead}"
    )


def _load_directory(args: Any) -> tuple[str, Path] | None:
    """The flag and the folder Megatron-LM 0.19's ``load_checkpoint`` reads a global
    checkpoint from
    (``checkpointing.py``: the ``--pretrained-checkpoint`` fallback where ``--load`` tracks
    nothing, ``_load_base_checkpoint``'s tracker read as ``read_metadata`` reads it,
    ``--ckpt-step``, ``release``), or None where it reads none here: no folder, a tracker
    it refuses itself, non-persistent checkpoints on (one may win), or a format it loads
    without dist_checkpointing (``--ckpt-format torch`` without auto-detection)."""
    from .megatron.checkpoint.files import TRACKER, iteration_dir

    flag, load = "--load", getattr(args, "load", None)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained and not (load and Path(load, TRACKER).is_file()):
        flag, load = "--pretrained-checkpoint", pretrained
    formats = ("torch_dist", "fsdp_dtensor")
    dist = getattr(args, "ckpt_format", "torch_dist") in formats or getattr(
        args, "auto_detect_ckpt_format", False
    )
    if not load or not dist or getattr(args, "non_persistent_ckpt_type", None):
        return None
    tracker, iteration, release = Path(load, TRACKER), -1, False
    if tracker.is_file():
        text = tracker.read_text(errors="replace").strip()
        try:
            iteration = int(text)
        except ValueError:
            if text != "release":
                return None  # Megatron-LM refuses the tracker itself
            iteration, release = 0, True
    step = getattr(args, "ckpt_step", None)
    if step:
        iteration = step
    if release:
        return flag, Path(load, "release")
    return (flag, iteration_dir(load, iteration)) if iteration >= 0 else None


def unscheduled_flag(args: Any) -> tuple[str, str] | None:
    """One of our arguments that act on a schedule, given without ``--pipeline-schedule``:
    (its name in ``args``, what it does), or None."""
    if _schedule(args) is not None:
        return None
    given = [flag for flag in _SCHEDULE_FLAGS if getattr(args, flag, None) is not None]
    return (given[0], _SCHEDULE_FLAGS[given[0]]) if given else None


def apply(args: Any, *, exit_on_error: bool = False) -> None:
    """Check ``args.pipeline_schedule`` against the rest of Megatron's (validated) arguments,
    and the checkpoint to load (:func:`check_load`). No-op without the argument. Under
    dualpipe with ``--overlap-grad-reduce`` it also sets ``args.ddp_num_buckets = 1`` (one
    DDP bucket per model chunk, see prepare_mirrors).

    Raises :class:`~megatron_dualpipe.megatron.schedule.checks.DualPipeConfigError`, one sentence
    saying what to change; with ``exit_on_error``, prints ``error: <sentence>`` and exits 2
    instead (for the launcher: no traceback per rank).
    """
    try:
        unscheduled = unscheduled_flag(args)
        if unscheduled is not None:
            name, does = unscheduled
            raise DualPipeConfigError(
                f"--{name.replace('_', '-')} {does}: give that schedule with --pipeline-schedule"
            )
        if _schedule(args) is None:
            return
        _check(args)
        check_load(args)
    except DualPipeConfigError as err:
        if not exit_on_error:
            raise
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def forward_backward_func(args: Any, megatrons: Callable[..., Any]) -> Callable[..., Any]:
    """The forward-backward function of this run: ours for a schedule our runtime runs
    (the same object every call with the same ``args``, so its executor is reused),
    else ``megatrons`` (what Megatron's ``get_forward_backward_func()`` returned); with
    ``--pipeline-timeline``, either measuring its second training step (:func:`_measured`;
    Megatron's the one of the run's first call). The first call of a run logs the schedule
    in use, once (on global rank 0)."""
    run = _run(args)
    found = run.spec
    ours = found is not None and found.runs_ours
    if not run.func_made:
        func = None
        if ours:
            from .megatron.compat.version import cuda_graph_setting
            from .megatron.schedule.forward_backward import DualPipeForwardBackward

            timeout_min = getattr(args, "distributed_timeout_minutes", None)
            options = {"timeout_s": 60.0 * timeout_min} if timeout_min else {}
            # --cuda-graph-impl full_iteration: Megatron-LM's train wraps this function in
            # FullCudaGraphWrapper, which captures its step whole.
            graph_safe = cuda_graph_setting(args)[0] == "full_iteration"
            func = DualPipeForwardBackward(found, graph_safe=graph_safe, **options)
            # Megatron-LM's --profile --use-pytorch-profiler: each action in a span, every
            # step of the run (the profiler's schedule keeps the steps it profiles).
            profiling = (getattr(args, k, False) for k in ("profile", "use_pytorch_profiler"))
            func.record_spans = all(profiling)
            saved = getattr(args, "pipeline_schedule_file", None)
            if saved is not None:  # checked in apply(): read as it was then
                func.use_schedule(read_saved_schedule(saved))
        if getattr(args, "pipeline_timeline", None) is not None:
            func = _measured(megatrons if func is None else func, found, args)
        run.func, run.func_made = func, True
        name = None if found is None else found.name
        _log_schedule(name, ours, megatrons, getattr(args, "pipeline_schedule_file", None))
    return megatrons if run.func is None else run.func


def _measured(func: Callable[..., Any], schedule: ScheduleSpec, args: Any) -> Any:
    """``func`` measuring its second training step
    (:class:`~.megatron.schedule.step_recorder.MeasuredForwardBackward`), numbered as
    Megatron-LM logs it (``args.curr_iteration`` + 1). It holds ``args`` weakly: the run's
    entry in ``_RUNS`` goes with them."""
    from .megatron.schedule.step_recorder import MeasuredForwardBackward

    held = weakref.ref(args)
    return MeasuredForwardBackward(
        func, schedule, iteration=lambda: getattr(held(), "curr_iteration", 0) + 1
    )


class MeasuredStep(NamedTuple):
    """``--pipeline-timeline``'s measured step (a SimResult in ms; None where the run ended
    before its second training step), its iteration, and the picture to draw it into."""

    measured: Any
    iteration: int | None
    png: str


def measured_step(args: Any) -> MeasuredStep | None:
    """``--pipeline-timeline``'s step of this run as the pipeline's rank 0 measured it (on
    another rank: as if nothing was measured); None without the flag. Call it after the
    run."""
    png = getattr(args, "pipeline_timeline", None)
    if png is None:
        return None
    run = _RUNS.get(id(args))
    func = None if run is None or run.args() is not args else run.func
    if func is None:
        return MeasuredStep(None, None, png)
    return MeasuredStep(func.measured, func.measured_iteration, png)


def cuda_graph_helper(args: Any, megatrons: Callable[..., Any]) -> Callable[..., Any]:
    """What Megatron-LM's ``train`` builds its CUDA-graph helper with (called with the
    arguments it passes ``TECudaGraphHelper``): under ``--cuda-graph-impl
    transformer_engine`` and a schedule our runtime runs, our ``TECudaGraphHelper`` for this
    pipeline rank, capturing TE's graphs in the order this run's schedule runs them
    (:mod:`.megatron.schedule.te_graphs`); else ``megatrons`` (Megatron's class, unchanged)."""
    from .megatron.compat.version import cuda_graph_setting

    found = _spec(args)
    if (
        found is None
        or not found.runs_ours
        or cuda_graph_setting(args)[0] != "transformer_engine"
    ):
        return megatrons
    from .megatron.schedule.te_graphs import helper_on_this_rank

    def schedule_for(pp_size: int, num_microbatches: int) -> Any:
        return forward_backward_func(args, None).schedule_to_run(pp_size, num_microbatches)

    return helper_on_this_rank(schedule_for)


def _log_schedule(
    schedule: str | None, ours: bool, megatrons: Callable[..., Any], saved: str | None = None
) -> None:
    """``pipeline schedule: ...`` on global rank 0: ours (in the order of the file ``saved``
    where one is run), or Megatron's function by name."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if ours:
        order = "" if saved is None else f", in the order saved in {saved}"
        logger.info("pipeline schedule: %s (megatron-dualpipe's%s)", schedule, order)
        return
    flag = "" if schedule is None else f", --pipeline-schedule {schedule}"
    name = getattr(megatrons, "__name__", type(megatrons).__name__)
    logger.info("pipeline schedule: Megatron's own (%s%s)", name, flag)


def places_model_chunks(args: Any) -> bool:
    """Whether this run's chunks sit in our placement (dualpipe, dualpipev)."""
    found = _spec(args)
    return found is not None and found.places_chunks


def builds_model_chunks(args: Any) -> bool:
    """Whether :func:`build_model_chunks` builds this run's model: every schedule our
    runtime runs (zb1p, dualpipe, dualpipev), so that its chunks defer their weight
    gradients as ``train``'s do."""
    found = _spec(args)
    return found is not None and found.runs_ours


def build_model_chunks(
    model_provider: Callable[..., Any],
    args: Any,
    config_from_args: Callable[[Any], Any],
    *,
    pp_rank: int,
    config: Any = None,
    **provider_kwargs: Any,
) -> list[Any]:
    """This pipeline rank's model chunks, chunk 0 first, in the schedule's placement,
    through the same :func:`~megatron_dualpipe.megatron.model.chunks.build_chunks` as ``train``.

    Calls ``model_provider(pre_process=, post_process=, vp_stage=, config=, **provider_kwargs)``
    once per chunk with the chunk's own ends. The config is ``config_from_args(args)``
    (Megatron's ``core_transformer_config_from_args``), or ``config`` when given; under
    dualpipe and dualpipev its ``pipeline_model_parallel_layout`` is our
    :class:`~megatron_dualpipe.megatron.model.placement.StagePlacementLayout` (the split arguments
    read over the model stages; the MTP block where the loss is; a given ``config`` must
    already carry one), so that Megatron's layer builders give each chunk its global layers
    (and parameter names). With ``--transformer-impl transformer_engine`` (Megatron-LM's
    default) under a schedule that splits the backward, the TE layers are built with
    ``delay_wgrad_compute``. Then, before ``get_model`` wraps them: copies of the embedding
    in the rank's two chunks are marked as one parameter and every linear layer, the output
    layer included, defers its dW (DDP must then come from :func:`ddp_config`).
    """
    from .megatron.compat.version import mtp_block_on_any_chunk
    from .megatron.model.chunks import ChunkEnds, build_chunks, model_config
    from .megatron.model.placement import StagePlacementLayout, config_chunk_roles

    setup = _setup(args)
    places = setup.spec.places_chunks
    if config is None:
        source = args
        if places:
            layout = StagePlacementLayout(setup, getattr(args, "mtp_num_layers", None))
            source = argparse.Namespace(**{**vars(args), **_SPLIT_ARGS})
            source.pipeline_model_parallel_layout = layout
        config = config_from_args(source)
    impl = getattr(args, "transformer_impl", "transformer_engine")
    config = model_config(config, setup.spec, impl)
    ends = [
        ChunkEnds(r.pre_process, r.post_process, r.chunk if places else None)
        for r in config_chunk_roles(config, setup, pp_rank)
    ]

    def build_with(chunk_config: Any, pre_process: bool, post_process: bool, vp_stage: Any) -> Any:
        with mtp_block_on_any_chunk():
            return model_provider(
                pre_process=pre_process,
                post_process=post_process,
                vp_stage=vp_stage,
                config=chunk_config,
                **provider_kwargs,
            )

    chunks = build_chunks(
        lambda e: build_with(config, e.pre_process, e.post_process, e.vp_stage), ends, setup.spec
    )
    if setup.spec.placement == "v" and getattr(args, "seed", None):
        _values_as_1f1b(chunks, args, config, lambda c, pre, post: build_with(c, pre, post, None))
    return chunks


def _values_as_1f1b(chunks: list[Any], args: Any, config: Any, build: Callable) -> None:
    """dualpipev's chunks with the initial values Megatron-LM's 1F1B gives their layers
    (:mod:`.megatron.model.seeding`), where the split allows; else one log line."""
    from .megatron.compat.version import cuda_graph_setting
    from .megatron.model.seeding import megatron_lm_seed, values_as_1f1b

    graphs = cuda_graph_setting(args)[0] != "none"
    done = values_as_1f1b(
        chunks,
        setup=_setup(args),
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        config=config,
        build=build,
        seed_as=lambda k: megatron_lm_seed(args, k, graphs),
    )
    if not done:
        logger.warning(
            "dualpipev: this split puts layers of two 1F1B pipeline ranks in one model chunk "
            "(or 1F1B's own split is uneven), so a fresh run starts from other initial values "
            "than Megatron's 1F1B: load a 1F1B checkpoint to compare the two"
        )


def ddp_config(config: Any, args: Any) -> Any:
    """``get_model``'s DistributedDataParallelConfig for this run: under a schedule our
    runtime runs that splits the backward, the same fields with ``delay_wgrad_compute``
    (Megatron DDP then hooks each deferred weight through its layer); else ``config``."""
    if not builds_model_chunks(args):
        return config
    from .megatron.model.chunks import ddp_config as for_schedule
    from .megatron.model.chunks import ddp_config_fields

    fields = ddp_config_fields(config)
    del fields["delay_wgrad_compute"]  # Megatron-LM's --delay-wgrad-compute: set here
    return for_schedule(_spec(args), **fields)


def float16_chunks(model: Sequence[Any], config: Any, args: Any, *, pp_rank: int) -> list[Any]:
    """``get_model``'s Float16Module wrapping for dualpipe / dualpipev: each chunk converts
    its output to fp32 where our placement puts the loss (Megatron's own wrapper looks for
    it on the last pipeline rank)."""
    from .megatron.model.placement import chunk_roles
    from .megatron.model.precision import StageFloat16Module

    roles = chunk_roles(_setup(args), pp_rank)
    return [
        StageFloat16Module(config, chunk, pre_process=r.pre_process, post_process=r.post_process)
        for chunk, r in zip(model, roles, strict=True)
    ]


def prepare_model(model: Sequence[Any], args: Any) -> None:
    """After building and wrapping: make dualpipe's two copies of every stage start equal
    (a collective over the pipeline group) and save the mirrored copy as a replica of the
    other (its chunk's ``sharded_state_dict``, which Megatron-LM's checkpointing calls,
    marks every item so), then each copy of the embedding on a rank equal to the embedding
    (Megatron zeroes them and, with our embedding group, leaves them so). No-op for other
    schedules."""
    if not places_model_chunks(args):
        return
    from .megatron.model.tied import copy_tied_params

    if _spec(args).placement == "mirror":
        from .megatron.checkpoint.replicas import save_as_mirror_replicas
        from .megatron.grads.mirror import prepare_mirrors

        prepare_mirrors(model)
        save_as_mirror_replicas(model[1])
    copy_tied_params(model)


def embedding_ranks(args: Any, pp_ranks: list[int]) -> list[int] | None:
    """Megatron's embedding group of one pipeline (``pretrain_gpt.get_embedding_ranks``):
    under dualpipe and dualpipev only its first rank (the embedding's copies share a rank
    and are summed there, dualpipe's two copies of a stage by the mirror sum), so Megatron's
    embedding all-reduce does nothing; None: Megatron's own choice."""
    from .megatron.model.placement import embedding_ranks as ranks_of

    ranks = ranks_of(_spec(args))
    return None if ranks is None else ranks(pp_ranks)


def full_batch_on_this_rank(args: Any) -> bool:
    """Whether a data-loading rank must receive every field of the batch (tokens and labels)
    over tensor parallelism: under dualpipe and dualpipev the first pipeline rank (and for
    dualpipe the last) holds both an embedding and a loss."""
    return places_model_chunks(args)


def losses_on_last_stage(losses: list[dict[str, Any]], args: Any) -> list[dict[str, Any]]:
    """Move the per-micro-batch loss reports (and Megatron's MTP loss tracker) to the last
    pipeline stage, where Megatron's training loop averages and logs them.

    Under dualpipe and dualpipev the losses are computed on pipeline rank 0 (dualpipe: and on
    the last rank); every pipeline rank calls this (a collective over the pipeline group):
    the last stage gets all reports, the others an empty list. Other schedules: unchanged.
    """
    if not places_model_chunks(args):
        return losses
    from .megatron.grads.loss_reports import mtp_losses_to_last_stage, reports_to_last_stage

    if getattr(args, "mtp_num_layers", None):
        mtp_losses_to_last_stage(args.mtp_num_layers)
    return reports_to_last_stage(losses)
