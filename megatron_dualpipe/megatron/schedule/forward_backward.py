"""The forward-backward function of our schedules, with Megatron-Core's exact signature.

``DualPipeForwardBackward("dualpipev")`` is a callable that Megatron's training loop can
call where it calls ``forward_backward_pipelining_without_interleaving``: it runs this
rank's part of the schedule with the runtime executor, each local model chunk wrapped as a
:class:`~.stage.MegatronStage`, and honours the config hooks Megatron's schedules honour
(``grad_sync_func`` is never called; ``param_sync_func`` once per chunk at a step's start).
Keep one object per training run: it owns the executors, dualpipe's mirror pair, the wait
timeout and the timeline sink, and checks the configuration once. Process groups, gradient
sync and what is refused: docs/megatron.md ("Selecting a schedule", "What the function
honours, and what it refuses"); the communication plan: docs/runtime.md.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.cuda_graphs import is_graph_capturing
from megatron.core.utils import get_model_config, unwrap_model

from ...runtime import DEFAULT_TIMEOUT_S, PipelineExecutor, RankTimeline, TensorSpec
from ...runtime.mirror import MirrorPair
from ...schedules.ir import Action, Kind, Schedule
from ...schedules.pipeline_setup import PipelineSetup
from ...schedules.registry import ScheduleSpec
from ...schedules.step_collectives import grad_final_points
from ..grads.deferral import te_layers_left_to_plan
from ..grads.mirror import (
    SLICE_BYTES,
    mirror_pair,
    sync_mirror_expert_loads,
    sync_mirror_gradients,
)
from ..model.placement import config_chunk_roles
from ..model.tied import sum_tied_gradients
from .checks import DualPipeConfigError, check_run, schedule_spec
from .schedule_plan import plan_supported
from .stage import MegatronStage, StepInputs

__all__ = ["DualPipeForwardBackward", "OverlapReport", "TimelineSink", "stage_input_spec"]

logger = logging.getLogger(__name__)

_NO_TIMELINE = (
    "a graph-safe forward-backward function records no timeline (a timeline reads CUDA "
    "events on the host): record timelines with graph_safe off"
)

#: Receives each recorded step: this rank's timeline and the schedule it ran.
TimelineSink = Callable[[RankTimeline, Schedule], None]


def stage_input_spec(
    config: Any,
    seq_length: int,
    micro_batch_size: int,
    tp_size: int,
    device: torch.device | None = None,
) -> TensorSpec:
    """What every stage receives and sends (an activation forward, its gradient backward):
    Megatron's hidden states, ``(sequence, micro-batch, hidden)`` with the sequence split
    over the tensor-parallel ranks under sequence parallelism, in ``pipeline_dtype``."""
    seq = seq_length // tp_size if config.sequence_parallel else seq_length
    shape = (seq, micro_batch_size, config.hidden_size)
    return TensorSpec(shape, config.pipeline_dtype or torch.float32, device)


@dataclass(frozen=True)
class _Groups:
    """The process groups one step runs with, and this rank's place in the pipeline."""

    pipeline: dist.ProcessGroup
    pp_rank: int
    pp_size: int
    tp_size: int
    cp_size: int
    pg_collection: Any


def _groups(p2p_communicator: Any, pg_collection: Any, schedule: str) -> _Groups:
    """The step's groups: from ``parallel_state``, or from the explicit arguments."""
    if p2p_communicator is None and pg_collection is None:
        pipeline = parallel_state.get_pipeline_model_parallel_group()
        return _Groups(
            pipeline=pipeline,
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            cp_size=parallel_state.get_context_parallel_world_size(),
            pg_collection=None,
        )
    if p2p_communicator is None or pg_collection is None:
        raise DualPipeConfigError(
            f"{schedule}: pass both p2p_communicator and pg_collection, or neither (as "
            "Megatron's own schedules require)"
        )
    pipeline = p2p_communicator.pp_group
    if getattr(pg_collection, "pp", pipeline) is not pipeline:
        raise DualPipeConfigError(
            f"{schedule}: p2p_communicator.pp_group and pg_collection.pp are different "
            "groups: pass the same pipeline group in both"
        )
    return _Groups(
        pipeline=pipeline,
        pp_rank=pipeline.rank(),
        pp_size=pipeline.size(),
        tp_size=pg_collection.tp.size() if getattr(pg_collection, "tp", None) else 1,
        cp_size=pg_collection.cp.size() if getattr(pg_collection, "cp", None) else 1,
        pg_collection=pg_collection,
    )


@dataclass(frozen=True)
class OverlapReport:
    """Of this rank's FB actions in the last training step, how many ran overlapped."""

    overlapped: int
    fb_actions: int


@dataclass
class _Prepared:
    """One model's executor and stages, made once and reused every step."""

    executor: PipelineExecutor
    stages: list[MegatronStage]
    key: tuple


class DualPipeForwardBackward:
    """Megatron's forward-backward signature, running ``schedule`` (one the registry says
    our runtime runs: zb1p, dualpipe, dualpipev; a name is resolved to its spec here, once).

    ``timeout_s`` bounds every pipeline wait (messages, mirror exchanges) and defaults to
    Megatron-LM's ``--distributed-timeout-minutes`` default. ``graph_safe`` builds every
    executor in its graph-safe mode (:class:`~..runtime.PipelineExecutor`'s ``graph_safe``),
    so that a step can be captured whole by Megatron's ``FullCudaGraphWrapper``
    (``cuda_graph_impl: full_iteration``): no host synchronisation inside the step, static
    shapes, no timeline; the losses it returns are device tensors, read after the step.
    ``mirror_slice_bytes`` is the most bytes one exchange of dualpipe's mirror sum moves.
    """

    def __init__(
        self,
        schedule: ScheduleSpec | str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        graph_safe: bool = False,
        mirror_slice_bytes: int = SLICE_BYTES,
    ):
        self.spec = schedule if isinstance(schedule, ScheduleSpec) else schedule_spec(schedule)
        if not self.spec.runs_ours:
            raise DualPipeConfigError(
                f"{self.spec.name} is Megatron-Core's own schedule: use Megatron's "
                "get_forward_backward_func for it"
            )
        self.timeout_s = timeout_s
        #: Receives every training step's recorded timeline (see :meth:`recording`).
        self.timeline_sink: TimelineSink | None = None
        self.graph_safe = graph_safe
        self.mirror_slice_bytes = mirror_slice_bytes
        # Keyed by the first model chunk, held weakly: a dropped model drops its executor.
        self._prepared: weakref.WeakKeyDictionary[Any, _Prepared] = weakref.WeakKeyDictionary()
        self._mirror_pairs: dict[tuple[int, ...], MirrorPair] = {}
        #: The schedule run in place of the generated one (see :meth:`use_schedule`).
        self.schedule: Schedule | None = None
        #: FB overlap in the last training step (None before one).
        self.last_overlap: OverlapReport | None = None
        #: Put every action of a step in a ``torch.profiler`` span (``F stage=S mb=M``, ...);
        #: off, the executors make no profiler call.
        self.record_spans = False

    @property
    def schedule_name(self) -> str:
        """The schedule's name, as ``--pipeline-schedule`` spells it."""
        return self.spec.name

    def __repr__(self) -> str:
        return f"DualPipeForwardBackward({self.schedule_name!r})"

    @contextlib.contextmanager
    def recording(self, sink: TimelineSink) -> Iterator[None]:
        """Within the block, every training step records its timeline (each action's start
        and end; ranks aligned by a barrier first) and hands it to ``sink``; refused on a
        graph-safe object (its steps read no CUDA events)."""
        if self.graph_safe:
            raise DualPipeConfigError(_NO_TIMELINE)
        previous, self.timeline_sink = self.timeline_sink, sink
        try:
            yield
        finally:
            self.timeline_sink = previous

    def use_schedule(self, schedule: Schedule | None) -> None:
        """Run ``schedule`` (a reordering of the generated schedule's work, such as an
        optimised or a saved one) from the next step on; None: the generated one again.
        Every executor is rebuilt at its next step; the next step checks that ``schedule``
        has the generated schedule's placement and refuses it in one sentence otherwise.
        Call it on every pipeline rank between the same two steps."""
        self.schedule = schedule
        for prepared in list(self._prepared.values()):
            prepared.executor.close()
        self._prepared.clear()

    def executor(self, model: Any) -> PipelineExecutor | None:
        """The executor this object runs ``model`` (its chunk list, or chunk 0) with, or
        None before its first step (or after the model was dropped)."""
        first = model[0] if isinstance(model, list | tuple) else model
        prepared = self._prepared.get(first)
        return None if prepared is None else prepared.executor

    # -- set-up, once per model -----------------------------------------------------------
    def _prepare(
        self,
        model: list[Any],
        config: Any,
        groups: _Groups,
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
    ) -> _Prepared:
        """This model's executor: checked, generated and built on first use, then reused
        while the model, the micro-batch count and the activation shape stay the same."""
        device = _device_of(model[0])
        spec = stage_input_spec(config, seq_length, micro_batch_size, groups.tp_size, device)
        key = (tuple(id(m) for m in model), num_microbatches, spec.shape, groups.pp_size)
        prepared = self._prepared.get(model[0])
        if prepared is not None and prepared.key == key:
            return prepared
        if prepared is not None:
            prepared.executor.close()  # its helper threads go with it
        check_run(
            self.spec,
            pipeline_size=groups.pp_size,
            num_microbatches=num_microbatches,
            virtual_pipeline_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
            context_parallel_size=groups.cp_size,
        )
        schedule = self.schedule_to_run(groups.pp_size, num_microbatches)
        setup = PipelineSetup(self.spec, groups.pp_size)
        roles = config_chunk_roles(config, setup, groups.pp_rank)
        overlap = self._overlap(config, model)
        stages = [
            MegatronStage(m, role, overlap=overlap) for m, role in zip(model, roles, strict=True)
        ]
        executor = PipelineExecutor(
            schedule,
            groups.pp_rank,
            stages,
            specs=dict.fromkeys(range(schedule.placement.num_stages), spec),
            loss_fn=lambda loss, mb: loss,
            group=groups.pipeline,
            defer_weight_grads=True,
            timeout_s=self.timeout_s,
            variable_shapes=bool(config.variable_seq_lengths),
            free_outputs=config.deallocate_pipeline_outputs,
            graph_safe=self.graph_safe,
            watch_paused=is_graph_capturing,
        )
        prepared = _Prepared(executor, stages, key)
        self._prepared[model[0]] = prepared
        return prepared

    def schedule_to_run(self, pp_size: int, num_microbatches: int) -> Schedule:
        """The generated schedule, or the one given to :meth:`use_schedule` where it has
        the generated one's placement."""
        generated = self.spec.generate(pp_size, num_microbatches)
        given = self.schedule
        if given is None:
            return generated
        if given.placement != generated.placement:
            p, q = given.placement, generated.placement
            raise DualPipeConfigError(
                f"schedule {given.name} runs the {p.kind} placement on {p.num_ranks} ranks, "
                f"{p.num_stages} stages and {p.num_microbatches} micro-batches, but this "
                f"{self.schedule_name} run has the {q.kind} placement on {q.num_ranks} ranks, "
                f"{q.num_stages} stages and {q.num_microbatches} micro-batches: use a schedule "
                "made for this run"
            )
        return given

    def _overlap(self, config: Any, model: list[Any]) -> bool:
        """Whether FB pairs run overlapped: ``overlap_moe_expert_parallel_comm`` on, and
        every chunk a GPTModel (which builds Megatron's schedule plan); otherwise FB pairs
        stay sequential, and the log says so once."""
        if not getattr(config, "overlap_moe_expert_parallel_comm", False):
            return False
        if all(plan_supported(m) for m in model):
            return True
        for index, chunk in enumerate(model):
            left = te_layers_left_to_plan(chunk)
            if left and not plan_supported(chunk):
                raise DualPipeConfigError(
                    f"{self.schedule_name}: overlap_moe_expert_parallel_comm is on but model "
                    f"chunk {index} is a {_inner_type(chunk)}, not a GPTModel with Megatron's "
                    f"schedule plan, so nothing would run the deferred weight gradients of its "
                    f"{len(left)} Transformer Engine layers ({left[0]}, ...), which Megatron's "
                    "plan runs: build the chunks as GPTModels or turn "
                    "overlap_moe_expert_parallel_comm off before enabling weight-gradient deferral"
                )
        logger.warning(
            "%s: overlap_moe_expert_parallel_comm is on but the model chunks are not GPTModels "
            "with Megatron's schedule plan: FB pairs run sequentially",
            self.schedule_name,
        )
        return False

    # -- one step ------------------------------------------------------------------------
    def __call__(
        self,
        *,
        forward_step_func: Callable[..., Any],
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable | None = None,
        p2p_communicator: Any = None,
        pg_collection: Any = None,
        force_all_reduce: bool | None = False,
    ) -> list[Any]:
        """Run one step; returns Megatron's ``forward_data_store`` (the loss function's
        reduced outputs) on ranks that compute a loss, else []."""
        name = self.schedule_name
        if adjust_tensor_shapes_fn is not None:
            raise DualPipeConfigError(f"{name} does not support adjust_tensor_shapes_fn")
        if decoder_seq_length is not None and decoder_seq_length != seq_length:
            raise DualPipeConfigError(
                f"{name} runs decoder-only models: decoder_seq_length must be None or seq_length"
            )
        model = list(model) if isinstance(model, list | tuple) else [model]
        config = get_model_config(model[0])
        groups = _groups(p2p_communicator, pg_collection, name)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(
                barrier=config.barrier_with_L1_time
            )
        prepared = self._prepare(
            model, config, groups, num_microbatches, seq_length, micro_batch_size
        )
        executor, stages = prepared.executor, prepared.stages
        schedule, rank = executor.schedule, executor.rank
        step = StepInputs(
            forward_step_func=forward_step_func,
            config=config,
            num_microbatches=num_microbatches,
            collect_non_loss_data=collect_non_loss_data,
            forward_only=forward_only,
            first_val_step=first_val_step,
            cp_group_size=groups.cp_size,
            device=_device_of(model[0]),
        )
        for stage, data in zip(stages, _chunk_data(data_iterator, schedule, stages), strict=True):
            stage.begin_step(step, data)
        if not forward_only and config.param_sync_func is not None:
            # Every chunk's gather at once, at the step's start, as Megatron's interleaved
            # schedule launches its first two chunks': each overlaps the work before the
            # chunk's first forward, whose DDP pre-hook waits for it.
            syncs = _as_list(config.param_sync_func, len(model))
            for sync, chunk in zip(syncs, model, strict=True):
                sync(chunk.parameters())
        executor.loss_fn = _loss_root(config, forward_only)
        executor.record_spans = self.record_spans

        entering = {
            m: torch.empty(0)
            for m in range(num_microbatches)
            if schedule.placement.rank_of(schedule.placement.path(m)[0]) == rank
        }
        grad_sync = _GradSync(config, len(model), grad_final_points(schedule.ranks[rank]))
        if not forward_only:
            for chunk in range(len(model)):
                grad_sync.disable(chunk)
        sink = None if forward_only else self.timeline_sink
        try:
            result = executor.run(
                entering,
                forward_only=forward_only,
                action_context=None if forward_only else grad_sync.around,
                record_timeline=sink is not None,
            )
        finally:
            for stage in stages:
                stage.begin_step(None, None)
        if sink is not None:
            sink(result.timeline, schedule)
        if not forward_only:
            fb_actions = sum(a.kind is Kind.FB for a in schedule.ranks[rank])
            self.last_overlap = OverlapReport(result.overlapped, fb_actions)

        if not forward_only:
            for chunk in range(len(model)):
                grad_sync.enable(chunk)
            self._finish_gradients(model, config, groups, step, force_all_reduce, schedule)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return step.forward_data_store

    def _finish_gradients(
        self,
        model: list[Any],
        config: Any,
        groups: _Groups,
        step: StepInputs,
        force_all_reduce: bool | None,
        schedule: Schedule,
    ) -> None:
        """What Megatron's schedules do after the last backward: finalize (data parallel
        reduction, layer-norm and embedding sync, expert-bias update; the reductions were
        launched by DDP's hooks: docs/megatron.md); then the sums over the copies of
        a parameter on this rank (:mod:`.tied`) and over dualpipe's two copies of every stage
        (whose expert-bias token counts are summed before finalize)."""
        pair = self._mirror_pair(groups.pipeline) if schedule.placement.kind == "mirror" else None
        if pair is not None and getattr(config, "moe_router_enable_expert_bias", False):
            sync_mirror_expert_loads(model, pair)
        if config.finalize_model_grads_func is not None:
            num_tokens = None
            if config.calculate_per_token_loss:
                # Loss stages need not be on the last rank: sum the counts over the pipeline
                # (finalize_model_grads then broadcasts the last rank's total).
                num_tokens = step.total_num_tokens.clone()
                dist.all_reduce(num_tokens, group=groups.pipeline)
            config.finalize_model_grads_func(
                model,
                num_tokens,
                pg_collection=groups.pg_collection,
                force_all_reduce=force_all_reduce,
            )
        sum_tied_gradients(model)
        if pair is not None:
            sync_mirror_gradients(model, pair)

    def _mirror_pair(self, pipeline: dist.ProcessGroup) -> MirrorPair:
        """This rank and its mirror rank on ``pipeline``, made at the first step that needs
        it, kept after."""
        key = tuple(dist.get_process_group_ranks(pipeline))
        if key not in self._mirror_pairs:
            self._mirror_pairs[key] = mirror_pair(
                pipeline, timeout_s=self.timeout_s, slice_bytes=self.mirror_slice_bytes
            )
        return self._mirror_pairs[key]


def _inner_type(chunk: torch.nn.Module) -> str:
    """The class name of the model inside Megatron's wrappers (DDP, Float16Module)."""
    return type(unwrap_model(chunk)).__name__


def _device_of(chunk: torch.nn.Module) -> torch.device:
    first = next(iter(chunk.parameters()), None)
    return torch.device("cpu") if first is None else first.device


def _as_list(value: Any, n: int) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value] * n


def _chunk_data(
    data_iterator: Any, schedule: Schedule, stages: Sequence[MegatronStage]
) -> list[Iterator[Any] | None]:
    """Per local chunk, an iterator over the micro-batches that chunk processes.

    A list of iterators (one per chunk, as for Megatron's interleaved schedule) is used as
    given. A single iterator is read once for the whole step (``num_microbatches`` items)
    and each chunk gets the micro-batches whose path passes through its stage.
    """
    if isinstance(data_iterator, list | tuple):
        if len(data_iterator) != len(stages):
            raise DualPipeConfigError(
                f"{schedule.name} needs one data iterator per model chunk ({len(stages)}), "
                f"got {len(data_iterator)}"
            )
        return list(data_iterator)
    if data_iterator is None:
        return [None] * len(stages)
    p = schedule.placement
    batches = [next(data_iterator) for _ in range(p.num_microbatches)]
    return [
        iter([b for m, b in enumerate(batches) if stage.role.stage in p.path(m)])
        for stage in stages
    ]


class _GradSync:
    """Keeps every chunk's DDP in no_sync, except during its grad-final actions."""

    def __init__(self, config: Any, num_chunks: int, points: set[tuple[Kind, int, int]]):
        funcs = config.no_sync_func or contextlib.nullcontext
        self._no_sync = _as_list(funcs, num_chunks)
        self._contexts: list[Any] = [None] * num_chunks
        self._points = points

    def disable(self, chunk: int) -> None:
        if self._contexts[chunk] is None:
            self._contexts[chunk] = self._no_sync[chunk]()
            self._contexts[chunk].__enter__()

    def enable(self, chunk: int) -> None:
        if self._contexts[chunk] is not None:
            self._contexts[chunk].__exit__(None, None, None)
            self._contexts[chunk] = None

    @contextlib.contextmanager
    def around(self, action: Action) -> Iterator[None]:
        final = (action.kind, action.stage, action.microbatch) in self._points
        if final:
            self.enable(action.chunk)
        try:
            yield
        finally:
            if final:
                self.disable(action.chunk)


def _loss_root(config: Any, forward_only: bool) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """What the backward starts from at a loss stage: the (divided) loss, scaled by
    ``grad_scale_func`` as Megatron's backward_step scales it."""
    scale = config.grad_scale_func
    if scale is None or forward_only:
        return lambda loss, mb: loss
    return lambda loss, mb: scale(loss)
