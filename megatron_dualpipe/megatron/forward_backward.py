"""The forward-backward function of our schedules, with Megatron-Core's exact signature.

``make_forward_backward_func("dualpipev")`` returns a function that Megatron's training loop
can call where it calls ``forward_backward_pipelining_without_interleaving``. It runs this
rank's part of the schedule with the runtime executor, each local model chunk wrapped as a
:class:`~.stage.MegatronStage`, and honours the config hooks Megatron's schedules honour:
``no_sync_func``, ``grad_sync_func``, ``finalize_model_grads_func``, ``grad_scale_func``,
``timers``, ``variable_seq_lengths``, ``calculate_per_token_loss``.

Gradient synchronisation with deferred dW: a parameter's gradient is complete after its
chunk's last backward (parameters computed with dX, e.g. norms) or after its chunk's last W
(deferred weights). Gradient sync is enabled for exactly those two actions of each chunk, so
that DDP's grad-ready hooks (with ``overlap_grad_reduce``) see each parameter once, when
its gradient is final.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from ..runtime import PipelineExecutor, RankTimeline, TensorSpec
from ..schedules.generators import generate
from ..schedules.ir import Action, Kind, Schedule
from .checks import check_model, check_run
from .mirror import sync_mirror_gradients
from .placement import chunk_roles
from .stage import MegatronStage, StepInputs

__all__ = ["make_forward_backward_func", "record_timelines"]

#: Where recorded steps go while :func:`record_timelines` is active.
_timeline_sink: Callable[[RankTimeline, Schedule], None] | None = None


@contextlib.contextmanager
def record_timelines(sink: Callable[[RankTimeline, Schedule], None]) -> Iterator[None]:
    """Within the block, every step of our schedules records its timeline (each action's
    start and end; ranks aligned by a barrier first) and hands it to ``sink`` with the
    schedule. Megatron's signature has no room for this, hence a context."""
    global _timeline_sink
    previous, _timeline_sink = _timeline_sink, sink
    try:
        yield
    finally:
        _timeline_sink = previous


def make_forward_backward_func(schedule: str) -> Callable[..., list[Any]]:
    """Megatron's forward-backward signature, running ``schedule`` (zb1p, dualpipe or
    dualpipev) with our runtime."""
    return partial(_forward_backward, schedule)


def _as_list(value: Any, n: int) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value] * n


def _chunk_data(
    data_iterator: Any, schedule: Schedule, rank: int, stages: Sequence[MegatronStage]
) -> list[Iterator[Any] | None]:
    """Per local chunk, an iterator over the micro-batches that chunk processes.

    A list of iterators (one per chunk, as for Megatron's interleaved schedule) is used as
    given. A single iterator is read once for the whole step (``num_microbatches`` items)
    and each chunk gets the micro-batches whose path passes through its stage.
    """
    if isinstance(data_iterator, list | tuple):
        if len(data_iterator) != len(stages):
            raise ValueError(
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


def _grad_sync_points(schedule: Schedule, rank: int) -> set[tuple[Kind, int, int]]:
    """The actions after which a chunk's gradients are final: its last backward (B or BW)
    and, when its dW is deferred, its last W."""
    last: dict[tuple[int, str], Action] = {}
    for action in schedule.ranks[rank]:
        for half in action.computes:
            if half.kind in (Kind.B, Kind.BW):
                last[(half.chunk, "backward")] = half
            elif half.kind is Kind.W:
                last[(half.chunk, "weight")] = half
    return {(a.kind, a.stage, a.microbatch) for a in last.values()}


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


def _specs(
    schedule: Schedule, config: Any, seq_length: int, micro_batch_size: int
) -> dict[int, TensorSpec]:
    """Every stage receives [seq / TP (sequence parallel), micro-batch, hidden] activations."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    seq = seq_length // tp if config.sequence_parallel else seq_length
    shape = (seq, micro_batch_size, config.hidden_size)
    dtype = config.pipeline_dtype or torch.float32
    return {s: TensorSpec(shape, dtype) for s in range(schedule.placement.num_stages)}


_EXECUTORS: dict[tuple, tuple[PipelineExecutor, list[MegatronStage]]] = {}
_BACKWARD_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _backward_group() -> dist.ProcessGroup | None:
    """A second group over this rank's pipeline ranks, for gradients, where the backend
    ignores tags (NCCL): it keeps the two directions between a pair of ranks apart.

    Creating groups is collective over the whole world: every rank learns every pipeline
    group and creates one backward group per pipeline group, in the same order.
    """
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_backend(pp_group) == "gloo":
        return None
    mine = tuple(dist.get_process_group_ranks(pp_group))
    if mine not in _BACKWARD_GROUPS:
        every: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        for ranks in sorted(set(every)):
            group = dist.new_group(list(ranks))
            if ranks == mine:
                _BACKWARD_GROUPS[ranks] = group
    return _BACKWARD_GROUPS[mine]


def _executor(
    schedule_name: str, model: list[Any], num_microbatches: int, specs_key: tuple, make_specs
) -> tuple[PipelineExecutor, list[MegatronStage]]:
    """One executor per (schedule, model chunks, micro-batches, activation spec)."""
    key = (schedule_name, tuple(id(m) for m in model), num_microbatches, specs_key)
    if key not in _EXECUTORS:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        rank = parallel_state.get_pipeline_model_parallel_rank()
        config = get_model_config(model[0])
        schedule = generate(schedule_name, pp, num_microbatches)
        roles = chunk_roles(schedule_name, pp, rank, config.num_layers)
        stages = [MegatronStage(m, role) for m, role in zip(model, roles, strict=True)]
        timeout = getattr(config, "distributed_timeout_minutes", None)
        executor = PipelineExecutor(
            schedule,
            rank,
            stages,
            specs=make_specs(schedule),
            loss_fn=lambda loss, mb: loss,
            group=parallel_state.get_pipeline_model_parallel_group(),
            backward_group=_backward_group(),
            defer_weight_grads=True,
            timeout_s=60.0 * timeout if timeout else 600.0,
            variable_shapes=bool(config.variable_seq_lengths),
        )
        _EXECUTORS[key] = (executor, stages)
    return _EXECUTORS[key]


def _forward_backward(
    schedule_name: str,
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
    """Run one step of ``schedule_name``; returns Megatron's ``forward_data_store`` (the
    loss function's reduced outputs) on ranks that compute a loss, else []."""
    del decoder_seq_length, p2p_communicator  # single-stack models; our own communicator
    model = list(model) if isinstance(model, list | tuple) else [model]
    config = get_model_config(model[0])
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    check_run(
        schedule_name,
        pipeline_size=pp,
        num_microbatches=num_microbatches,
        config=config,
        virtual_pipeline_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
    )
    check_model(schedule_name, model)
    if adjust_tensor_shapes_fn is not None:
        raise ValueError(f"{schedule_name} does not support adjust_tensor_shapes_fn")
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    specs_key = (seq_length, micro_batch_size, config.sequence_parallel)
    executor, stages = _executor(
        schedule_name,
        model,
        num_microbatches,
        specs_key,
        lambda s: _specs(s, config, seq_length, micro_batch_size),
    )
    schedule, rank = executor.schedule, executor.rank
    step = StepInputs(
        forward_step_func=forward_step_func,
        config=config,
        num_microbatches=num_microbatches,
        collect_non_loss_data=collect_non_loss_data,
        forward_only=forward_only,
        first_val_step=first_val_step,
        cp_group_size=parallel_state.get_context_parallel_world_size(),
    )
    for stage, data in zip(stages, _chunk_data(data_iterator, schedule, rank, stages), strict=True):
        stage.begin_step(step, data)
    executor.loss_fn = _loss_root(config, forward_only)

    entering = {
        m: torch.empty(0)
        for m in range(num_microbatches)
        if schedule.placement.rank_of(schedule.placement.path(m)[0]) == rank
    }
    grad_sync = _GradSync(config, len(model), _grad_sync_points(schedule, rank))
    if not forward_only:
        for chunk in range(len(model)):
            grad_sync.disable(chunk)
    sink = _timeline_sink
    result = executor.run(
        entering,
        forward_only=forward_only,
        action_context=None if forward_only else grad_sync.around,
        record_timeline=sink is not None,
    )
    if sink is not None:
        sink(result.timeline, schedule)
    for stage in stages:
        stage.begin_step(None, None)

    if not forward_only:
        for chunk in range(len(model)):
            grad_sync.enable(chunk)
        if config.grad_sync_func is not None:
            for func, chunk in zip(_as_list(config.grad_sync_func, len(model)), model, strict=True):
                func(chunk.parameters())
        if config.finalize_model_grads_func is not None:
            num_tokens = None
            if config.calculate_per_token_loss:
                # Loss stages need not be on the last rank: sum the counts over the pipeline
                # (finalize_model_grads then broadcasts the last rank's total).
                num_tokens = step.total_num_tokens.clone()
                dist.all_reduce(
                    num_tokens, group=parallel_state.get_pipeline_model_parallel_group()
                )
            config.finalize_model_grads_func(
                model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce
            )
        if schedule.placement.kind == "mirror":
            sync_mirror_gradients(model)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return step.forward_data_store


def _loss_root(config: Any, forward_only: bool) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """What the backward starts from at a loss stage: the (divided) loss, scaled by
    ``grad_scale_func`` as Megatron's backward_step scales it."""
    scale = config.grad_scale_func
    if scale is None or forward_only:
        return lambda loss, mb: loss
    return lambda loss, mb: scale(loss)
