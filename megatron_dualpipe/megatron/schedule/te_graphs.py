"""``cuda_graph_impl: transformer_engine`` under our schedules: Megatron-Core's
``TECudaGraphHelper`` capturing TE's per-layer graphs in the order the rank runs them.

``ScheduleTECudaGraphHelper`` overrides ``_get_sample_arguments`` to put the schedule's
order (:func:`~...schedules.cuda_graphs.cuda_graph_order`) into the ``_order`` list Megatron
lays the static input buffers out by and hands TE's ``make_graphed_callables``, so TE
captures, and the buffers follow, our order; replay picks a chunk's graph by the
``current_microbatch`` ``MegatronStage`` sets. It also drops the keyword
``_reuse_graph_input_output_buffers`` Megatron hands TE: a deferred W may read a graph's
buffers after later graphs ran. How and why: docs/megatron.md, "CUDA graphs".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...schedules.cuda_graphs import check_cuda_graph_order, cuda_graph_order
from ...schedules.ir import Schedule
from .checks import DualPipeConfigError

__all__ = ["graph_order", "helper_on_this_rank", "schedule_te_cuda_graph_helper"]

#: The schedule a rank runs, from its pipeline size and the step's micro-batches.
ScheduleFor = Callable[[int, int], Schedule]


def graph_order(schedule: Schedule, rank: int, *, wgrad: bool) -> tuple[list[float], int]:
    """``rank``'s ``_order`` for TE (wgrad entries only with ``wgrad``: the graphed layers
    defer their dW to TE's wgrad graphs) and the micro-batches each of its chunks runs,
    checked against TE's rules (:func:`~..schedules.cuda_graphs.check_cuda_graph_order`;
    raises its :class:`~..schedules.cuda_graphs.CudaGraphOrderError`)."""
    order = cuda_graph_order(schedule, rank)
    if not wgrad:
        order = [entry for entry in order if entry == int(entry)]
    chunks = schedule.placement.num_chunks
    per_chunk = sum(entry > 0 for entry in order) // chunks
    check_cuda_graph_order(order, chunks, per_chunk, wgrad=wgrad)
    return order, per_chunk


def schedule_te_cuda_graph_helper(
    schedule_for: ScheduleFor, *, pp_size: int, rank: int, wgrad: bool
) -> type:
    """A subclass of Megatron-Core's ``TECudaGraphHelper`` (constructed as Megatron's is)
    whose capture order is ``schedule_for(pp_size, num_microbatches)``'s for ``rank``."""
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    class ScheduleTECudaGraphHelper(TECudaGraphHelper):
        """``TECudaGraphHelper`` capturing in the order of the schedule our runtime runs."""

        def _get_sample_arguments(self, order: list[Any], chunk_id_list: Any = None) -> Any:
            """Replace Megatron's interleaved ``order`` (the list ``_order`` is) by the
            schedule's, then let Megatron lay out the static inputs by it (Megatron's
            layout reads forwards and backwards only; its check counts no wgrad entry)."""
            if chunk_id_list is not None:
                raise DualPipeConfigError(
                    "cuda_graph_impl transformer_engine with overlap_moe_expert_parallel_comm "
                    "graphs each layer in Megatron's combined 1F1B order, which our schedules "
                    "do not run: turn one of them off"
                )
            # Megatron set num_microbatches to the step's (get_num_microbatches()).
            schedule = schedule_for(pp_size, self.num_microbatches)
            ours, self.num_microbatches = graph_order(schedule, rank, wgrad=wgrad)
            order[:] = ours
            return super()._get_sample_arguments([e for e in ours if e == int(e)])

        def _get_cuda_graph_input_data(self) -> tuple[Any, dict[str, Any]]:
            """Megatron's sample arguments and TE keywords, without TE's reuse of graph
            buffers (docs/megatron.md, "CUDA graphs"): a deferred W may read them after
            later graphs ran."""
            sample_args, kwargs = super()._get_cuda_graph_input_data()
            kwargs.pop("_reuse_graph_input_output_buffers", None)
            return sample_args, kwargs

    return ScheduleTECudaGraphHelper


def helper_on_this_rank(schedule_for: ScheduleFor, *, wgrad: bool = False) -> Callable[..., Any]:
    """A stand-in for the ``TECudaGraphHelper`` class, called with its arguments (as
    Megatron-LM's ``train`` calls it): our helper for this process's pipeline rank, read
    from Megatron's ``parallel_state`` when it is built."""

    def build(*args: Any, **kwargs: Any) -> Any:
        from megatron.core import parallel_state

        cls = schedule_te_cuda_graph_helper(
            schedule_for,
            pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
            rank=parallel_state.get_pipeline_model_parallel_rank(),
            wgrad=wgrad,
        )
        return cls(*args, **kwargs)

    return build
