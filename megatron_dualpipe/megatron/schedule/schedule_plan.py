"""Megatron-Core's fine-grained schedule plan, driven for one model chunk at a time.

With ``overlap_moe_expert_parallel_comm`` a GPTModel builds a
``TransformerModelChunkSchedulePlan`` per micro-batch, and
``TransformerModelChunkSchedulePlan.run(f_plan, b_plan, b_grad)`` runs one micro-batch's
forward interleaved with another's backward, layer by layer. This module drives those
plans as Megatron's ``combined_1f1b.combined_forward_backward_step`` does (its autocast and
FP8 contexts included), except that whether the stage ends in a loss is given, not read
from ``parallel_state``. A micro-batch forwarded through a plan is backwarded through it
too. TE's ``backward_dw()`` calls of the plan's W nodes go through
:func:`~..grads.te_wgrad.exactly`.
How and why: docs/megatron.md, "F&B overlap: MoE all-to-all hidden behind the other
micro-batch".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.enums import Fp8Recipe
from megatron.core.fp8_utils import get_fp8_context
from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
from megatron.core.pipeline_parallel.utils import ScheduleNode, get_comp_stream, set_streams
from megatron.core.utils import get_attr_wrapped_model, unwrap_model
from torch import nn

from ...runtime.weight_grad_store import WeightGradStore, active_store, defers
from ..compat.cpu_compat import schedule_plan_context
from ..compat.version import layer_plan_nodes
from ..grads.te_wgrad import exactly, te_layer_classes

__all__ = [
    "PlanHandle",
    "autocast_context",
    "outer_fp8_context",
    "plan_supported",
    "run_plans",
    "start_forward",
]


def plan_supported(model: torch.nn.Module) -> bool:
    """Whether ``model`` (wrappers allowed) can build Megatron's schedule plan: a GPTModel."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    return isinstance(unwrap_model(model), GPTModel)


@dataclass
class PlanHandle:
    """A micro-batch forwarded through its plan: what its backward needs (with the
    weight-gradient store its forward ran under, if any)."""

    plan: Any
    loss_node: ScheduleNode | None
    store: WeightGradStore | None
    config: Any


@dataclass
class ForwardStart:
    """A forward whose plan is built, not yet run: the plan, its model's config and what
    finishes it."""

    plan: Any
    config: Any
    finish: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, PlanHandle]]


def autocast_context(config: Any) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` as Megatron's forward steps enter it (``enable_autocast``)."""
    if getattr(config, "enable_autocast", False):
        return torch.autocast("cuda", dtype=config.autocast_dtype)
    return contextlib.nullcontext()


def outer_fp8_context(config: Any) -> contextlib.AbstractContextManager[Any]:
    """The FP8 context around a whole pass: FP8's delayed recipe only (Megatron's rule in
    ``combined_forward_backward_step`` and ``TransformerBlock``)."""
    if getattr(config, "fp8", None) and config.fp8_recipe == Fp8Recipe.delayed:
        return get_fp8_context(config)
    return contextlib.nullcontext()


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
    with autocast_context(config):
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
        return output, num_tokens, PlanHandle(plan, loss_node, store, config)

    return ForwardStart(plan, config, finish)


def _output_grad(handle: PlanHandle, root: torch.Tensor, grad: torch.Tensor | None):
    """The gradient the plan's backward starts from: ``grad``, or at a loss stage the
    gradient the (scaled) loss ``root`` gives the plan's output."""
    if grad is not None:
        return grad
    torch.autograd.backward(root)
    return handle.loss_node.get_grad()


def _te_layers(node: Any) -> list[nn.Module]:
    """The TE layers whose ``backward_dw()`` a W node calls (through its modules)."""
    classes = te_layer_classes()
    callables = getattr(node, "bwd_dw_callables", None) or []
    if not classes:
        return []
    return [
        m
        for c in callables
        if isinstance(c, nn.Module)
        for m in c.modules()
        if isinstance(m, classes)
    ]


def _exact_dw(node: Any, backward_dw: Callable[[], None]) -> None:
    with exactly(_te_layers(node)):
        backward_dw()


def _route_weight_grads(handle: PlanHandle) -> None:
    """The backward plan's W nodes (its layers' ``backward_dw``, which run Transformer
    Engine's deferred dW) made exact on every TE release (:func:`~..grads.te_wgrad.exactly`) and,
    while the handle's store captures (a B action), deferred into the store in the order
    the plan issues them."""
    store = handle.store
    for i in range(handle.plan.num_layers()):
        for node in layer_plan_nodes(handle.plan.get_layer(i)):
            work = functools.partial(_exact_dw, node, node.backward_dw)
            node.backward_dw = functools.partial(store.defer, work) if defers(store) else work


def run_plans(
    forward: ForwardStart | None,
    backward: tuple[PlanHandle, torch.Tensor, torch.Tensor | None] | None,
) -> tuple[torch.Tensor, torch.Tensor, PlanHandle] | None:
    """Run ``forward``'s plan and ``backward``'s (handle, root, output gradient) together,
    interleaved layer by layer (either may be None), under Megatron's contexts (module
    docstring); returns the finished forward."""
    b_plan = b_grad = None
    if backward is not None:
        handle, root, grad = backward
        b_plan, b_grad = handle.plan, _output_grad(handle, root, grad)
        _route_weight_grads(handle)
    f_plan = forward.plan if forward is not None else None
    config = forward.config if forward is not None else backward[0].config
    with schedule_plan_context(), autocast_context(config), outer_fp8_context(config):
        output = type(f_plan or b_plan).run(f_plan, b_plan, b_grad=b_grad)
    return None if forward is None else forward.finish(output)
