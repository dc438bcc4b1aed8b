"""Transformer Engine's deferred dW under DualPipe's order, on stand-ins of TE 2.7 and
TE >= 2.8 (the releases differ in what ``backward_dw()`` does to ``.grad``).

No TE or CUDA here: each stand-in reproduces, for one TE release, what its linear layer
does with ``delay_wgrad_compute=True`` (see :class:`_StandInTELinear`). What must hold:
through :func:`enable_weight_grad_deferral`, with two micro-batches' entries outstanding
(B0, B1, W0, W1) and a full backward between (B0, B1, BW2, W0, W1), every weight and bias
gradient equals plain autograd's, on both releases, with and without a Megatron-DDP-like
hook, with a bias under FP8 and with fused accumulation; TE's own ``backward_dw()`` in the
same order loses or breaks something in each of those cases (shown too, so the tests
would fail without the fix). The schedule plan's W nodes get the same treatment.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dualpipe.megatron.grads import deferral, te_wgrad
from megatron_dualpipe.megatron.grads.deferral import (
    WeightGradDeferralError,
    enable_weight_grad_deferral,
    te_layers_left_to_plan,
)
from megatron_dualpipe.megatron.schedule import schedule_plan
from megatron_dualpipe.runtime import WeightGradStore

pytestmark = pytest.mark.megatron

SIZE, TOKENS = 6, 4
REL_TOL = 1e-6


class _TEFunction(torch.autograd.Function):
    """The main backward of TE's ``_Linear`` (``pytorch/module/linear.py``, v2.7 and v2.10)
    with ``delay_wgrad_compute``: dX now; the wgrad GEMM (fused with the bias gradient
    unless FP8) put into the module's ``wgrad_store``; under FP8 the bias gradient computed
    now (``grad_output_preprocess``) and returned to autograd, the entry's ``bgrad`` None;
    with fused accumulation a placeholder weight gradient marked ``grad_added_to_main_grad``
    (TE's ``get_dummy_wgrad``, whose values are never meant to be read: NaN here)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Any, module: Any):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.use_bias, ctx.fp8 = module, bias is not None, module.fp8
        out = x.matmul(weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        module = ctx.module
        fp8_bias = ctx.use_bias and ctx.fp8
        module.wgrad_store.append(functools.partial(module.wgrad_gemm, x, grad, fp8_bias))
        grad_bias = grad.sum(0) if fp8_bias else None
        wgrad = None
        if module.fuse_wgrad_accumulation and hasattr(module.weight, "grad_added_to_main_grad"):
            module.weight.grad_added_to_main_grad = True
            wgrad = torch.full_like(weight, float("nan"))
        return grad.matmul(weight), wgrad, grad_bias, None


class _StandInTELinear(torch.nn.Module):
    """A TE ``Linear`` with ``delay_wgrad_compute=True`` as TE 2.7 or TE >= 2.8 behaves
    (``TransformerEngineBaseModule.backward_dw`` in ``pytorch/module/base.py``; the
    weight's ``.grad`` rule changed in TE PR #2142, first released in 2.8):

    - weights and biases marked ``skip_backward_post_hook`` (TE's ``Linear.__init__``);
    - ``wgrad_store``: a FIFO, one entry per backward, ``backward_dw()`` pops the oldest
      (``WeightGradStore`` in ``pytorch/module/_common.py``);
    - ``backward_dw()``: unless fused, the weight's ``.grad`` is set only when None (2.7) or
      always (2.8+); the bias's only when None, from the entry's ``bgrad`` (``None.to``
      fails under FP8); then every registered hook fires.
    - ``fp8`` is set by each forward (``init_fp8_metadata``)."""

    def __init__(self, release: str, *, bias: bool, fused: bool, fp8: bool) -> None:
        super().__init__()
        self.release = release
        self.weight = torch.nn.Parameter(torch.randn(SIZE, SIZE) / SIZE**0.5)
        self.bias = torch.nn.Parameter(torch.randn(SIZE) * 0.1) if bias else None
        self.use_bias, self.fuse_wgrad_accumulation, self._fp8_recipe = bias, fused, fp8
        self.fp8 = False
        self.weight_names, self.bias_names = ["weight"], ["bias"] if bias else []
        self.config = SimpleNamespace(delay_wgrad_compute=True)
        self.wgrad_store: deque[Callable[[], tuple[Any, Any]]] = deque()
        self.wgrad_accumulation_and_reduce_hooks: list[Callable[[], None]] = []
        for p in self.parameters():
            p.skip_backward_post_hook = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fp8 = self._fp8_recipe
        return _TEFunction.apply(x, self.weight, self.bias, self)

    def wgrad_gemm(self, x: torch.Tensor, grad: torch.Tensor, fp8_bias: bool):
        bgrad = None if fp8_bias or not self.use_bias else grad.sum(0)
        wgrad = grad.t().matmul(x)
        if self.fuse_wgrad_accumulation:
            self.weight.main_grad += wgrad
            return None, bgrad
        return wgrad, bgrad

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def backward_dw(self) -> None:
        wgrad, bgrad = self.wgrad_store.popleft()()
        if not self.fuse_wgrad_accumulation and (
            self.release == "2.8+" or self.weight.grad is None
        ):
            self.weight.grad = wgrad
        if self.use_bias and self.bias.grad is None:
            self.bias.grad = bgrad.to(self.bias.dtype)
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


def _ddp_hook(param: torch.nn.Parameter, overlap_grad_reduce: bool) -> Callable[[], None]:
    """Megatron DDP's grad-ready hook (``DistributedDataParallel._make_backward_post_hook``,
    megatron-core 0.16.1): under ``overlap_grad_reduce`` it asserts a ``.grad``; it adds
    ``.grad`` into ``main_grad`` unless ``grad_added_to_main_grad``, then clears it."""

    def hook() -> None:
        if overlap_grad_reduce:
            assert param.grad is not None, "param.grad being None is not safe"
        if param.grad is not None and not getattr(param, "grad_added_to_main_grad", False):
            param.main_grad.add_(param.grad)
        param.grad = None

    return hook


@pytest.fixture
def stand_in_te(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deferral, "_te_layer_classes", lambda: (_StandInTELinear,))
    monkeypatch.setattr(deferral, "_check_te_version", lambda: None)
    monkeypatch.setattr(schedule_plan, "te_layer_classes", lambda: (_StandInTELinear,))


def _model(release: str, *, bias: bool, fused: bool, fp8: bool, ddp: bool) -> Any:
    torch.manual_seed(0)
    layers = [_StandInTELinear(release, bias=bias, fused=fused, fp8=fp8) for _ in range(2)]
    model = torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1])
    for layer in layers:
        for p in layer.parameters():
            if ddp or fused:
                p.main_grad = torch.zeros_like(p)
                p.grad_added_to_main_grad = False  # as Megatron DDP sets it (__init__)
            if ddp:
                layer.register_wgrad_accumulation_and_reduce_hooks(
                    _ddp_hook(p, overlap_grad_reduce=True)
                )
    return model


def _reference(model: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    plain = torch.nn.Sequential(torch.nn.Linear(SIZE, SIZE), torch.nn.Tanh())
    plain.append(torch.nn.Linear(SIZE, SIZE))
    with torch.no_grad():
        for ours, theirs in zip(model[::2], plain[::2], strict=True):
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias if ours.bias is not None else torch.zeros(SIZE))
    for x in inputs:
        plain(x).square().sum().backward()
    return [g for layer in plain[::2] for g in (layer.weight.grad, layer.bias.grad)]


def _grads(model: Any) -> list[torch.Tensor | None]:
    """Each layer's total weight and bias gradient (``main_grad`` plus what ``.grad``
    still holds)."""
    out = []
    for layer in model[::2]:
        for p in (layer.weight, layer.bias):
            if p is None:
                out.append(None)
                continue
            total = getattr(p, "main_grad", torch.zeros_like(p)).clone()
            if p.grad is not None and not getattr(p, "grad_added_to_main_grad", False):
                total += p.grad
            out.append(total)
    return out


def _dualpipe_order(model: Any, inputs: list[torch.Tensor], run_w: Callable[..., None]) -> None:
    """B0, B1, a full backward of micro-batch 2, W0, W1 (DualPipe's order: two entries
    outstanding, and a BW that pops the oldest)."""
    store = WeightGradStore()
    with store.active():
        losses = [model(x).square().sum() for x in inputs]
    for key in (0, 1):
        with store.capture(key):
            losses[key].backward()
    losses[2].backward()
    run_w(store, 0)
    run_w(store, 1)


def _inputs() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(TOKENS, SIZE, requires_grad=True) for _ in range(3)]


CASES = [
    pytest.param(release, bias, fused, fp8, ddp, id=f"{release}-{name}")
    for release in ("2.7", "2.8+")
    for name, bias, fused, fp8, ddp in (
        ("no-ddp", True, False, False, False),
        ("ddp", True, False, False, True),
        ("ddp-fp8-bias", True, False, True, True),
        ("no-ddp-fp8-bias", True, False, True, False),
        ("ddp-fused", False, True, False, True),
    )
]


@pytest.mark.usefixtures("stand_in_te")
@pytest.mark.parametrize(("release", "bias", "fused", "fp8", "ddp"), CASES)
def test_deferred_te_gradients_equal_autograd_on_each_release(
    release: str, bias: bool, fused: bool, fp8: bool, ddp: bool
) -> None:
    model = _model(release, bias=bias, fused=fused, fp8=fp8, ddp=ddp)
    inputs = _inputs()
    expected = _reference(model, [x.detach().requires_grad_() for x in inputs])
    assert enable_weight_grad_deferral(model) == 2
    _dualpipe_order(model, inputs, lambda store, key: store.run(key))
    for layer in model[::2]:
        assert not layer.wgrad_store
    for got, want in zip(_grads(model), expected, strict=True):
        if got is None:  # the layer has no bias
            continue
        assert (got - want).abs().max() <= REL_TOL * want.abs().max()


def test_te_own_backward_dw_in_dualpipe_order_loses_or_fails() -> None:
    """Without the fix (TE's own ``backward_dw()`` after all the main backwards): TE 2.7
    drops a dW, TE 2.8+ overwrites one, an FP8 bias fails and a fused weight trips DDP's
    assertion (the cases the test above holds)."""
    inputs = _inputs()

    def raw(release: str, **kind: bool) -> list[torch.Tensor | None]:
        model = _model(release, **kind)
        for x in inputs:
            model(x).square().sum().backward()
        for _ in inputs:
            for layer in model[::2]:
                layer.backward_dw()
        return _grads(model)

    plain = dict(bias=True, fused=False, fp8=False, ddp=False)
    for release in ("2.7", "2.8+"):
        detached = [x.detach().requires_grad_() for x in inputs]
        expected = _reference(_model(release, **plain), detached)
        assert (raw(release, **plain)[0] - expected[0]).abs().max() > 1e-3
    with pytest.raises(AttributeError):
        raw("2.8+", bias=True, fused=False, fp8=True, ddp=True)
    with pytest.raises(AssertionError, match="not safe"):
        raw("2.7", bias=False, fused=True, fp8=False, ddp=True)


@pytest.mark.usefixtures("stand_in_te")
def test_the_schedule_plans_w_nodes_are_exact_too() -> None:
    """A plan's W node calls ``backward_dw()`` of the TE layers of its modules (Megatron's
    ``TransformerLayerNode.backward_dw``); routed through the plan module, two outstanding
    entries of an FP8-biased layer give autograd's sums."""
    model = _model("2.8+", bias=True, fused=False, fp8=True, ddp=True)
    inputs = _inputs()[:2]
    expected = _reference(model, [x.detach().requires_grad_() for x in inputs])
    node = SimpleNamespace(bwd_dw_callables=[model])
    node.backward_dw = lambda: [layer.backward_dw() for layer in model[::2]]
    for x in inputs:
        model(x).square().sum().backward()
    for _ in inputs:
        schedule_plan._exact_dw(node, node.backward_dw)
    for got, want in zip(_grads(model), expected, strict=True):
        assert (got - want).abs().max() <= REL_TOL * want.abs().max()


class _Allocated(TorchDispatchMode):
    """Bytes of the new storages the ops create while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and (
                tensor.untyped_storage().data_ptr() not in inputs
            ):
                self.bytes += tensor.untyped_storage().nbytes()
        return out


@pytest.mark.usefixtures("stand_in_te")
def test_a_fused_weights_placeholder_takes_no_weight_sized_memory() -> None:
    """DualPipe's second ``backward_dw()`` of a fused layer finds the weight's ``.grad``
    consumed and hands DDP's hook a zero one: one element expanded to the weight's shape,
    not a ``zeros_like`` of the weight per call (36 floats, 144 bytes, here); the
    gradients still equal autograd's (the equality test's ``ddp-fused`` case)."""
    model = _model("2.8+", bias=False, fused=True, fp8=False, ddp=True)
    layers = list(model[::2])
    calls = 4
    meter = _Allocated()
    with meter:
        for _ in range(calls):
            with te_wgrad.exactly(layers):
                for layer in layers:
                    assert layer.weight.grad is not None and layer.weight.grad.shape == (SIZE, SIZE)
                    layer.weight.grad = None  # as DDP's hook leaves it
    assert meter.bytes == calls * len(layers) * 4  # one float per weight per call
    assert meter.bytes < SIZE * SIZE * 4  # less than one weight-sized zeros_like
    assert all(layer.weight.grad is None for layer in layers)


@pytest.mark.usefixtures("stand_in_te")
def test_te_layers_left_to_the_plan_are_named() -> None:
    model = _model("2.8+", bias=False, fused=False, fp8=False, ddp=False)
    for layer in model[::2]:
        layer.config.overlap_moe_expert_parallel_comm = True
    assert enable_weight_grad_deferral(model) == 2
    assert te_layers_left_to_plan(model) == ["0", "2"]
    assert (
        te_layers_left_to_plan(_model("2.7", bias=False, fused=False, fp8=False, ddp=False)) == []
    )


def test_te_2_3_is_refused_in_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE 2.3 to 2.6 have delay_wgrad_compute but no register_wgrad_accumulation_and_reduce_
    hooks (base.py at v2.3): Megatron DDP could not see a deferred gradient."""
    import megatron.core.utils as mcore_utils

    monkeypatch.setattr(mcore_utils, "is_te_min_version", lambda v: v <= "2.3.0")
    monkeypatch.setattr(mcore_utils, "get_te_version", lambda: "2.3.0")
    with pytest.raises(
        WeightGradDeferralError, match=r"needs Transformer Engine >= 2\.7\.0"
    ) as err:
        deferral._check_te_version()
    assert "found 2.3.0" in str(err.value) and "\n" not in str(err.value)
    assert te_wgrad.TE_MIN_VERSION == "2.7.0"
