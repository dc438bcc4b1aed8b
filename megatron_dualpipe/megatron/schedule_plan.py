"""Megatron-Core's fine-grained schedule plan, driven for one model chunk at a time.

With ``overlap_moe_expert_parallel_comm`` a GPTModel builds a
``TransformerModelChunkSchedulePlan`` per micro-batch (``build_schedule_plan``): the chunk's
layers split into nodes (attention, MoE dispatch, MLP/experts, MoE combine; compute and
communication streams). ``TransformerModelChunkSchedulePlan.run(f_plan, b_plan, b_grad)``
runs one micro-batch's forward interleaved with another's backward, layer by layer, so the
all-to-all of one hides behind the compute of the other. This module drives those plans as
Megatron's ``combined_1f1b.combined_forward_backward_step`` does, with one difference: the
stage's place in the pipeline (does it end in a loss?) is given, not read from
``parallel_state``, because our placements put the loss where Megatron's stage numbering
does not expect it.

A micro-batch forwarded through a plan is backwarded through it too: the plan's nodes are
autograd islands, so a plain ``backward`` from the output would stop at the last node.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
from megatron.core.pipeline_parallel.utils import ScheduleNode, get_comp_stream, set_streams
from megatron.core.utils import get_attr_wrapped_model

from ..runtime.weight_grad_store import WeightGradStore, active_store, defers
from .cpu_compat import schedule_plan_context
from .version import layer_plan_nodes

__all__ = ["PlanHandle", "plan_supported", "run_plans", "start_forward"]


def plan_supported(model: torch.nn.Module) -> bool:
    """Whether ``model`` (wrappers allowed) can build Megatron's schedule plan: a GPTModel."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    inner = get_attr_wrapped_model(model, "build_schedule_plan", return_model_obj=True)
    return isinstance(inner, GPTModel)


@dataclass
class PlanHandle:
    """A micro-batch forwarded through its plan: what its backward needs (with the
    weight-gradient store its forward ran under, if any)."""

    plan: Any
    loss_node: ScheduleNode | None
    store: WeightGradStore | None


@dataclass
class ForwardStart:
    """A forward whose plan is built, not yet run: the plan and what finishes it."""

    plan: Any
    finish: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, PlanHandle]]


def start_forward(
    model: torch.nn.Module,
    x: torch.Tensor | None,
    data: Iterator[Any] | None,
    *,
    forward_step_func: Callable[..., Any],
    config: Any,
    is_first_microbatch: bool,
    loss_stage: bool,
    num_microbatches: int,
    forward_data_store: list[Any],
    collect_non_loss_data: bool,
    cp_group_size: int,
) -> ForwardStart:
    """Set the chunk's input and build its plan through ``forward_step_func(data, gpt_model,
    return_schedule_plan=True)`` (Megatron's contract); the returned ``finish`` takes the
    plan's output and applies the loss function where the pipeline ends
    (``forward_step_calc_loss``: divided by micro-batches or tokens, MoE and MTP auxiliary
    loss scales, ``forward_data_store``), returning (output, tokens counted, handle)."""
    set_streams()
    if config.timers is not None:
        config.timers("forward-compute", log_level=2).start()
    if is_first_microbatch and hasattr(model, "set_is_first_microbatch"):
        model.set_is_first_microbatch()
    get_attr_wrapped_model(model, "set_input_tensor")([x])
    store = active_store()
    gpt_model = get_attr_wrapped_model(model, "build_schedule_plan", return_model_obj=True)
    plan, loss_func = forward_step_func(data, gpt_model, return_schedule_plan=True)

    def finish(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, PlanHandle]:
        loss_node = None
        if loss_stage:
            loss_node = ScheduleNode(loss_func, get_comp_stream(), plan.event, name="loss_func")
        output, num_tokens = forward_step_calc_loss(
            model,
            output,
            loss_node.forward if loss_node is not None else loss_func,
            config,
            getattr(model, "vp_stage", None),
            collect_non_loss_data,
            num_microbatches,
            forward_data_store,
            cp_group_size,
            is_last_stage=loss_stage,
        )
        return output, num_tokens, PlanHandle(plan, loss_node, store)

    return ForwardStart(plan, finish)


def _output_grad(handle: PlanHandle, root: torch.Tensor, grad: torch.Tensor | None):
    """The gradient the plan's backward starts from: ``grad``, or at a loss stage the
    gradient the (scaled) loss ``root`` gives the plan's output."""
    if grad is not None:
        return grad
    torch.autograd.backward(root)
    return handle.loss_node.get_grad()


@contextlib.contextmanager
def _weight_grads_deferred(handle: PlanHandle) -> Iterator[None]:
    """While the handle's store captures (a B action), the plan's own weight-gradient calls
    (its layers' ``backward_dw``, which run Transformer Engine's deferred dW) are deferred
    into the store as well, in the order the plan issues them."""
    store = handle.store
    if not defers(store):
        yield
        return
    nodes = []
    for i in range(handle.plan.num_layers()):
        nodes += layer_plan_nodes(handle.plan.get_layer(i))
    for node in nodes:
        node.backward_dw = functools.partial(store.defer, node.backward_dw)
    yield


def run_plans(
    forward: ForwardStart | None,
    backward: tuple[PlanHandle, torch.Tensor, torch.Tensor | None] | None,
) -> tuple[torch.Tensor, torch.Tensor, PlanHandle] | None:
    """Run ``forward``'s plan and ``backward``'s (handle, root, output gradient) together,
    interleaved layer by layer (either may be None); returns the finished forward."""
    b_plan = b_grad = None
    context: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if backward is not None:
        handle, root, grad = backward
        b_plan, b_grad = handle.plan, _output_grad(handle, root, grad)
        context = _weight_grads_deferred(handle)
    f_plan = forward.plan if forward is not None else None
    with schedule_plan_context(), context:
        output = type(f_plan or b_plan).run(f_plan, b_plan, b_grad=b_grad)
    return None if forward is None else forward.finish(output)
