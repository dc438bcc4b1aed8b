"""Weight-gradient (dW) deferral on Megatron-Core's own linear layers and on TE layers.

Makes Megatron's layers follow the protocol of the runtime's
:class:`~megatron_dualpipe.runtime.WeightGradStore`: while the store captures (a B) a layer's
dW becomes deferred work that the W runs; otherwise (a BW, or no store) it is computed at
once, and either way the layer accumulates it as autograd would and fires Megatron DDP's
wgrad hooks. Local layers become :class:`DeferrableColumnParallelLinear` /
:class:`DeferrableRowParallelLinear` (:func:`deferrable_layer_spec`, else
:func:`enable_weight_grad_deferral` before DDP wrapping, DDP built from
:func:`ddp_config_for_deferral`); TE layers built from :func:`with_delay_wgrad_compute` defer
their ``backward_dw()``. What is not supported raises :class:`WeightGradDeferralError`.
(docs/megatron.md, "Deferring dW"; recomputation: docs/training.md)
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.parallel_state import get_global_memory_buffer
from megatron.core.tensor_parallel import layers as _layers
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import (
    get_tensor_model_parallel_group_if_none,
    prepare_input_tensors_for_wgrad_compute,
)
from torch import nn

from ...errors import DualPipeError
from ...runtime.weight_grad_store import (
    WeightGradStore,
    accumulate_grad,
    active_store,
    defer_or_run,
    defers,
    fire_after,
)
from .te_wgrad import TE_MIN_VERSION, exact_backward_dw, te_layer_classes, te_weights

__all__ = [
    "DeferrableColumnParallelLinear",
    "DeferrableRowParallelLinear",
    "WeightGradDeferralError",
    "ddp_config_for_deferral",
    "deferrable_layer_spec",
    "enable_weight_grad_deferral",
    "te_layers_left_to_plan",
    "with_delay_wgrad_compute",
]

_TE_HOOK_ATTR = "_dualpipe_backward_dw_hook"
#: Set on a TE layer whose backward_dw() only Megatron's schedule plan calls.
_TE_PLAN_ATTR = "_dualpipe_dw_by_plan"


class WeightGradDeferralError(DualPipeError, RuntimeError):
    """A configuration that weight-gradient deferral does not support (one sentence)."""


# --------------------------------------------------------------------------------------
# Configuration helpers.


def ddp_config_for_deferral(**kwargs: Any) -> DistributedDataParallelConfig:
    """A ``DistributedDataParallelConfig`` for models with deferred weight gradients.

    Sets ``delay_wgrad_compute=True``, which makes Megatron's DDP hook deferred weights
    through their layer (docs/megatron.md, "Deferring dW"); every other field comes from
    ``kwargs``. Megatron-FSDP is refused: its hooks do not take that path.
    """
    if kwargs.get("delay_wgrad_compute") is False:
        raise WeightGradDeferralError(
            "ddp_config_for_deferral() needs delay_wgrad_compute=True: drop that argument"
        )
    if kwargs.get("use_megatron_fsdp"):
        raise WeightGradDeferralError(
            "weight-gradient deferral does not support Megatron-FSDP: use "
            "DistributedDataParallel (use_megatron_fsdp=False)"
        )
    kwargs["delay_wgrad_compute"] = True
    return DistributedDataParallelConfig(**kwargs)


def with_delay_wgrad_compute(config: TransformerConfig) -> TransformerConfig:
    """A shallow copy of ``config`` with ``delay_wgrad_compute=True``, for TE models.

    Build a TE-spec model from the copy so Megatron passes ``delay_wgrad_compute`` into its
    TE linear layers (extensions/transformer_engine.py). The field is set after
    construction on purpose: TransformerConfig's validation ties it to Megatron's own
    ``overlap_moe_expert_parallel_comm`` (combined 1F1B, EP > 1, bf16), which is not how
    this runtime drives ``backward_dw()``. Local (non-TE) layers ignore the field.
    """
    result = copy.copy(config)
    result.delay_wgrad_compute = True
    return result


# --------------------------------------------------------------------------------------
# Local layers: the autograd Function.


@dataclass(frozen=True)
class _Plan:
    """What one call of a converted layer does, fixed at forward time."""

    layer: _DeferrableParallelLinear
    fusion: bool
    allreduce_dgrad: bool
    sequence_parallel: bool
    tp_group: Any
    store: WeightGradStore | None


def _store_for_forward(module: nn.Module) -> WeightGradStore | None:
    """The store a deferring ``module``'s forward runs under: the active one (remembered on
    the module), else the one its last forward saw while that one captures a backward (a
    forward recomputed inside a B; docs/training.md), else None."""
    store = active_store()
    if store is not None:
        module._dualpipe_last_store = weakref.ref(store)
        return store
    last = getattr(module, "_dualpipe_last_store", None)
    remembered = last() if last is not None else None
    return remembered if remembered is not None and remembered.capturing else None


def _gather_sequence(inputs: torch.Tensor, group: Any, shared: bool) -> tuple[torch.Tensor, Any]:
    """Start the all-gather of ``inputs`` along dim 0 over ``group``; returns the output
    (Megatron's shared "mpu" buffer when ``shared``, else a tensor of its own) and the
    async handle."""
    size = list(inputs.size())
    size[0] *= group.size()
    if shared:
        total = get_global_memory_buffer().get_tensor(size, inputs.dtype, "mpu")
    else:
        total = torch.empty(size, dtype=inputs.dtype, device=inputs.device)
    handle = _layers.dist_all_gather_func(total, inputs, group=group, async_op=True)
    return total, handle


def _reduce_input_grad(
    grad_input: torch.Tensor, inputs: torch.Tensor, plan: _Plan
) -> tuple[torch.Tensor, Any]:
    """Start the tensor-parallel reduction of dX: all-reduce (``allreduce_dgrad``) or
    reduce-scatter (sequence parallelism); returns the tensor to return and the handle."""
    if plan.sequence_parallel:
        shard = torch.empty(inputs.size(), dtype=inputs.dtype, device=inputs.device)
        handle = _layers.dist_reduce_scatter_func(
            shard, grad_input, group=plan.tp_group, async_op=True
        )
        return shard, handle
    if plan.allreduce_dgrad:
        return grad_input, dist.all_reduce(grad_input, group=plan.tp_group, async_op=True)
    return grad_input, None


def _fused_accumulate(
    main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor
) -> None:
    """``main_grad += grad_output^T total_input`` with Megatron's fused CUDA kernel."""
    kernel = getattr(_layers, "fused_weight_gradient_mlp_cuda", None)
    if kernel is None:
        raise WeightGradDeferralError(
            "gradient_accumulation_fusion needs the fused_weight_gradient_mlp_cuda "
            "extension (APEX): install it or turn the fusion off"
        )
    if main_grad.dtype == torch.float32:
        kernel.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernel.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise WeightGradDeferralError(
            f"gradient_accumulation_fusion does not support {main_grad.dtype} main_grad"
        )


def _dummy_wgrad(weight: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
    """The placeholder ``.grad`` Megatron hands to DDP's hook after a fused accumulation
    (zeros when the parameter asks for ``zero_out_wgrad``)."""
    shape, device = weight.main_grad.shape, weight.main_grad.device
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _accumulate_weight_grad(
    layer: _DeferrableParallelLinear,
    weight: nn.Parameter,
    main_grad: torch.Tensor | None,
    fusion: bool,
    grad_output: torch.Tensor,
    total_input: torch.Tensor,
) -> None:
    """Add one dW (2-D ``grad_output`` and input) into the weight, as Megatron's backward
    plus autograd's accumulation would, then fire the layer's wgrad hooks."""
    if fusion:
        weight.main_grad = main_grad
        _fused_accumulate(main_grad, grad_output, total_input)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad = _dummy_wgrad(weight, total_input.dtype)
            weight.grad_added_to_main_grad = True
    else:
        accumulate_grad(weight, grad_output.t().matmul(total_input))
    fire_after(layer, layer.fire_wgrad_hooks)


class _DeferrableLinearFunction(torch.autograd.Function):
    """Megatron's linear with async TP communication, dW deferred while capturing."""

    @staticmethod
    @_layers.custom_fwd
    def forward(
        ctx: Any,
        inputs: torch.Tensor,
        weight: nn.Parameter,
        bias: torch.Tensor | None,
        plan: _Plan,
    ) -> torch.Tensor:
        ctx.save_for_backward(inputs, weight)
        ctx.param = weight  # the parameter itself; a saved tensor may be an alias
        ctx.main_grad = weight.main_grad if plan.fusion else None
        ctx.use_bias = bias is not None
        ctx.plan = plan
        if plan.sequence_parallel:
            total_input, handle = _gather_sequence(inputs, plan.tp_group, shared=True)
            handle.wait()
        else:
            total_input = inputs
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @_layers.custom_bwd
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs, weight = ctx.saved_tensors
        plan: _Plan = ctx.plan
        defer = defers(plan.store)
        gather = None
        if plan.sequence_parallel:
            # A deferred dW must not keep Megatron's shared buffer: later layers reuse it.
            total_input, gather = _gather_sequence(inputs, plan.tp_group, shared=not defer)
        else:
            total_input = inputs
        grad_input = grad_output.matmul(weight)
        if gather is not None:
            gather.wait()
        grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
        grad_input, reduction = _reduce_input_grad(grad_input, inputs, plan)
        wgrad = partial(
            _accumulate_weight_grad,
            plan.layer,
            ctx.param,
            ctx.main_grad,
            plan.fusion,
            grad_output,
            total_input,
        )
        defer_or_run(plan.store, wgrad)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        if reduction is not None:
            reduction.wait()
        return grad_input, None, grad_bias, None


# --------------------------------------------------------------------------------------
# Local layers: the converted classes.


class _DeferrableParallelLinear:
    """Mixin of the converted layers (instances get ``_wgrad_hooks`` and
    ``_deferral_name`` when converted)."""

    weight: nn.Parameter
    config: TransformerConfig
    _wgrad_hooks: list[Callable[[], Any]]
    _deferral_name: str

    def _init_deferral(self, name: str) -> None:
        """Join the dX/dW split: no wgrad hooks yet, DDP told to wait for them."""
        if self.config.defer_embedding_wgrad_compute:
            raise WeightGradDeferralError(
                f"{name}: defer_embedding_wgrad_compute is not supported with weight-gradient "
                "deferral: turn it off"
            )
        self._wgrad_hooks = []
        self._deferral_name = name
        if self.weight is not None and self.weight.requires_grad:
            self.weight.skip_backward_post_hook = True

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], Any]) -> None:
        """Called by Megatron DDP (``delay_wgrad_compute``): ``hook()`` runs after every
        accumulation of this layer's dW, in a W action or in a full backward."""
        self._wgrad_hooks.append(hook)

    def fire_wgrad_hooks(self) -> None:
        """Run the registered hooks, in registration order."""
        for hook in self._wgrad_hooks:
            hook()

    def deferred_parameters(self) -> Iterator[nn.Parameter]:
        """The weight, whose gradient waits for the W action while the store captures
        (the runtime's ``DeferrableLayer`` protocol)."""
        yield self.weight

    def _forward_impl(
        self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Megatron's ``_forward_impl`` contract (tensor_parallel/layers.py); deferrable when
        ``weight`` is this layer's own trainable weight, else Megatron's own path."""
        if weight is not self.weight or not weight.requires_grad:
            return super()._forward_impl(input, weight, *args, **kwargs)  # type: ignore[misc]
        return self._deferrable_linear(input, weight, *args, **kwargs)

    def _deferrable_linear(
        self,
        inputs: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        grad_output_buffer: list[torch.Tensor] | None = None,
        wgrad_deferral_limit: int | None = None,
        tp_group: Any = None,
        gtp_remat_size: int = 1,
    ) -> torch.Tensor:
        """``linear_with_grad_accumulation_and_async_allreduce``'s arguments (megatron-core
        0.19 adds ``gtp_remat_size``), run through :class:`_DeferrableLinearFunction` with
        the store active now."""
        self._check_call(weight, gradient_accumulation_fusion, grad_output_buffer)
        if gtp_remat_size > 1:
            raise WeightGradDeferralError(
                f"{self._deferral_name}: weights sharded over {gtp_remat_size} GTP ranks "
                "(Megatron-LM's --tensor-parallel-num-weight-shards) are not supported by "
                "weight-gradient deferral: leave the weights unsharded"
            )
        if sequence_parallel and allreduce_dgrad:
            raise WeightGradDeferralError(
                f"{self._deferral_name}: allreduce_dgrad and sequence_parallel cannot both be on"
            )
        if sequence_parallel or allreduce_dgrad:
            tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        plan = _Plan(
            layer=self,
            fusion=gradient_accumulation_fusion,
            allreduce_dgrad=allreduce_dgrad,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            store=_store_for_forward(self),
        )
        return _DeferrableLinearFunction.apply(inputs, weight, bias, plan)

    def _check_call(
        self,
        weight: torch.Tensor,
        fusion: bool,
        grad_output_buffer: list[torch.Tensor] | None,
    ) -> None:
        """Refuse, naming the layer, what the deferrable path does not implement."""
        name = self._deferral_name
        if grad_output_buffer is not None:
            raise WeightGradDeferralError(
                f"{name}: defer_embedding_wgrad_compute is not supported with "
                "weight-gradient deferral: turn it off"
            )
        if hasattr(weight, "__fsdp_param__"):
            raise WeightGradDeferralError(
                f"{name}: Megatron-FSDP parameters are not supported by weight-gradient deferral"
            )
        if fusion and not hasattr(weight, "main_grad"):
            raise WeightGradDeferralError(
                f"{name}: gradient_accumulation_fusion needs main_grad: wrap the model in "
                "Megatron DDP or turn the fusion off"
            )
        if hasattr(weight, "main_grad") and not self._wgrad_hooks:
            raise WeightGradDeferralError(
                f"{name}: the weight has a main_grad but no DDP hook reached this layer: call "
                "enable_weight_grad_deferral before wrapping in DistributedDataParallel and "
                "build it with ddp_config_for_deferral() (delay_wgrad_compute=True)"
            )


class DeferrableColumnParallelLinear(_DeferrableParallelLinear, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose weight gradient waits for the W action while the
    active store captures; built from :func:`deferrable_layer_spec` or converted by
    :func:`enable_weight_grad_deferral`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_deferral(type(self).__name__)


class DeferrableRowParallelLinear(_DeferrableParallelLinear, RowParallelLinear):
    """``RowParallelLinear`` whose weight gradient waits for the W action while the
    active store captures; built from :func:`deferrable_layer_spec` or converted by
    :func:`enable_weight_grad_deferral`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_deferral(type(self).__name__)


_CONVERSIONS: dict[type[nn.Module], type[nn.Module]] = {
    ColumnParallelLinear: DeferrableColumnParallelLinear,
    RowParallelLinear: DeferrableRowParallelLinear,
}


def deferrable_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` (a layer spec such as ``get_gpt_layer_local_spec()``) with every
    ``ColumnParallelLinear`` / ``RowParallelLinear`` in it, at any depth (attention, MLP,
    MoE experts and shared experts), replaced by its deferrable class; the rest unchanged."""
    return _replace_linears(spec)


def _replace_linears(item: Any) -> Any:
    if isinstance(item, type):
        return _CONVERSIONS.get(item, item)
    if isinstance(item, partial):  # 0.18+: a layer spec's MLP is a partial of its builder
        args = [_replace_linears(a) for a in item.args]
        keywords = {k: _replace_linears(v) for k, v in item.keywords.items()}
        return partial(item.func, *args, **keywords)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        changes = {
            f.name: _replace_linears(getattr(item, f.name))
            for f in dataclasses.fields(item)
            if f.init
        }
        return dataclasses.replace(item, **changes)
    return item


def _convert_local(layer: nn.Module, name: str) -> bool:
    """Switch one exact ColumnParallelLinear / RowParallelLinear to its deferrable class;
    False when the layer has no trainable weight of its own (left as it is)."""
    weight = getattr(layer, "weight", None)
    if weight is None or not weight.requires_grad:
        return False
    if hasattr(weight, "main_grad"):
        raise WeightGradDeferralError(
            f"{name}: the model is already wrapped in DistributedDataParallel: call "
            "enable_weight_grad_deferral before wrapping it"
        )
    layer.__class__ = _CONVERSIONS[type(layer)]
    layer._init_deferral(name)
    return True


# --------------------------------------------------------------------------------------
# Transformer Engine layers (lazy: nothing here imports transformer_engine).


def _te_layer_classes() -> tuple[type, ...]:
    """Megatron's TE layer classes (:func:`.te_wgrad.te_layer_classes`)."""
    return te_layer_classes()


def _check_te_version() -> None:
    from megatron.core.utils import get_te_version, is_te_min_version

    if not is_te_min_version(TE_MIN_VERSION):
        raise WeightGradDeferralError(
            f"deferring TE layers needs Transformer Engine >= {TE_MIN_VERSION} (its "
            "register_wgrad_accumulation_and_reduce_hooks is how Megatron DDP sees a deferred "
            f"gradient), found {get_te_version()}: upgrade Transformer Engine"
        )


class _AfterTEBackward(torch.autograd.Function):
    """Identity on a TE module's input. Its backward runs right after the module's own
    backward (which put one entry into the module's wgrad_store) and issues the matching
    ``backward_dw()``: deferred into the store while it captures, else at once."""

    @staticmethod
    def forward(
        ctx: Any, inputs: torch.Tensor, work: Callable[[], None], store: WeightGradStore | None
    ) -> torch.Tensor:
        ctx.work = work
        ctx.store = store
        return inputs.view_as(inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        defer_or_run(ctx.store, ctx.work)
        return grad, None, None


def _te_forward_pre_hook(name: str, module: nn.Module, args: tuple[Any, ...]) -> Any:
    """Route the first positional input of a TE module through :class:`_AfterTEBackward`."""
    weights = te_weights(module)
    if not torch.is_grad_enabled() or not any(w.requires_grad for w in weights):
        return None
    hooked = bool(getattr(module, "wgrad_accumulation_and_reduce_hooks", None))
    if not hooked and any(hasattr(w, "main_grad") for w in weights):
        raise WeightGradDeferralError(
            f"{name}: the weight has a main_grad but no DDP hook reached this TE layer: build "
            "DistributedDataParallel with ddp_config_for_deferral() (delay_wgrad_compute=True)"
        )
    if not args or not isinstance(args[0], torch.Tensor):
        raise WeightGradDeferralError(f"{name}: TE deferral needs the input as first argument")
    if not args[0].requires_grad:
        raise WeightGradDeferralError(
            f"{name}: TE deferral needs this layer's input to require grad"
        )
    work = partial(exact_backward_dw, module)  # exact on every TE release (.te_wgrad)
    return (_AfterTEBackward.apply(args[0], work, _store_for_forward(module)), *args[1:])


def _enable_te(module: nn.Module, name: str) -> bool:
    """Hook one TE layer into the store (idempotent); False for a frozen layer."""
    if getattr(module, _TE_HOOK_ATTR, None) is not None:
        return True
    if not any(w.requires_grad for w in te_weights(module)):
        return False
    _check_te_version()
    if not getattr(module.config, "delay_wgrad_compute", False):
        raise WeightGradDeferralError(
            f"{name}: this TE layer was built without delay_wgrad_compute: build the model "
            "from with_delay_wgrad_compute(config)"
        )
    if getattr(module.config, "overlap_moe_expert_parallel_comm", False):
        # Megatron's schedule plan calls backward_dw() itself (its layers' W nodes); the
        # planned stage defers those calls in B actions. A hook here would pop twice.
        setattr(module, _TE_PLAN_ATTR, True)
        return True
    handle = module.register_forward_pre_hook(partial(_te_forward_pre_hook, name))
    setattr(module, _TE_HOOK_ATTR, handle)
    return True


def te_layers_left_to_plan(model: nn.Module) -> list[str]:
    """The names of ``model``'s TE layers whose ``backward_dw()`` only Megatron's schedule
    plan calls (deferral with ``overlap_moe_expert_parallel_comm``): run without the plan,
    nobody would pop their wgrad store and their weight gradients would stay zero."""
    return [n for n, m in model.named_modules() if getattr(m, _TE_PLAN_ATTR, False)]


# --------------------------------------------------------------------------------------
# The switch.


def enable_weight_grad_deferral(model_chunks: nn.Module | Iterable[nn.Module]) -> int:
    """Make the Megatron linear layers of ``model_chunks`` defer dW while the runtime's
    store captures; returns how many layers of the chunks now defer (idempotent: a second
    call converts nothing new and returns the same number).

    Converted: every exact ``ColumnParallelLinear`` / ``RowParallelLinear`` with a trainable
    weight of its own (attention, MLP, MoE experts of SequentialMLP, output layer), and
    every TE linear layer when the model uses TE (docs/megatron.md). Must run
    before the chunks are wrapped in Megatron DDP, which must then be built with
    :func:`ddp_config_for_deferral`. Raises :class:`WeightGradDeferralError` for what is
    not supported, before changing anything in the offending layer.
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    te_classes = _te_layer_classes()
    count = 0
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, _DeferrableParallelLinear):
                module._deferral_name = name
                count += module.weight is not None and module.weight.requires_grad
            elif type(module) in _CONVERSIONS:
                count += _convert_local(module, name)
            elif te_classes and isinstance(module, te_classes):
                count += _enable_te(module, name)
    return count
