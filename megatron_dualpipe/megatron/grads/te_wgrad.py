"""Transformer Engine's deferred weight gradient, exact on every supported TE release and
under DualPipe's order of work.

:func:`exact_backward_dw` runs one ``backward_dw()`` of a TE linear layer built with
``delay_wgrad_compute=True`` (TE >= :data:`TE_MIN_VERSION`) by autograd's accumulation rule,
whatever the release and however many entries are outstanding: an earlier ``.grad`` that no
hook consumed is set aside and added back after the call, and an FP8 bias or a fused weight
whose ``.grad`` a hook consumed gets a zero one for DDP's hook. What each release does, and
why DualPipe's B0, B1, W0, W1 needs this: docs/megatron.md, "Transformer Engine layers".
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = [
    "TE_MIN_VERSION",
    "exact_backward_dw",
    "exactly",
    "te_biases",
    "te_layer_classes",
    "te_weights",
]

#: The oldest Transformer Engine whose deferred dW Megatron DDP can see.
TE_MIN_VERSION = "2.7.0"
_TE_EXTENSION = "megatron.core.extensions.transformer_engine"
_TE_CLASS_NAMES = ("TELinear", "TELayerNormColumnParallelLinear", "TEGroupedLinear")
_WEIGHT, _BIAS = re.compile(r"weight\d*"), re.compile(r"bias\d*")


def te_layer_classes() -> tuple[type, ...]:
    """Megatron's TE layer classes that take ``delay_wgrad_compute``, or () when Megatron's
    TE extension has not been imported (then no model holds a TE layer) or TE is absent."""
    extension = sys.modules.get(_TE_EXTENSION)
    if extension is None or not getattr(extension, "HAVE_TE", False):
        return ()
    found = (getattr(extension, name, None) for name in _TE_CLASS_NAMES)
    return tuple(cls for cls in found if isinstance(cls, type))


def _own(module: nn.Module, attr: str, pattern: re.Pattern[str]) -> list[nn.Parameter]:
    """The parameters TE lists in ``attr`` (``weight_names`` / ``bias_names``), else those
    whose names match ``pattern`` (GroupedLinear's ``weight0``, ``bias0``...); never the
    norm of a LayerNormLinear, whose gradient the main backward computes."""
    params = dict(module.named_parameters(recurse=False))
    names = getattr(module, attr, None)
    if names is None:
        names = [n for n in params if pattern.fullmatch(n)]
    return [params[n] for n in names if n in params]


def te_weights(module: nn.Module) -> list[nn.Parameter]:
    """A TE layer's weights whose gradient ``backward_dw()`` computes."""
    return _own(module, "weight_names", _WEIGHT)


def te_biases(module: nn.Module) -> list[nn.Parameter]:
    """A TE layer's biases (their gradient comes from ``backward_dw()``, or under FP8 from
    the main backward)."""
    return _own(module, "bias_names", _BIAS) if getattr(module, "use_bias", True) else []


def _zero_grad_for_hook(param: nn.Parameter) -> None:
    """A zero ``.grad`` where the hook would find None: adds nothing, and DDP's hook (which
    asserts a ``.grad`` under ``overlap_grad_reduce``) sees one. Autograd may accumulate
    into it later (an FP8 bias's next main backward), so it is a tensor of its own."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)


def _zero_placeholder_for_hook(weight: nn.Parameter) -> None:
    """A fused weight's zero ``.grad`` where the hook would find None, taking no memory of
    the weight's size: one zero element expanded to the weight's shape (DDP's hook only
    checks it is there, reads it at most, and clears it, in the same ``backward_dw()``;
    were anything to write into it, torch would refuse, not corrupt it)."""
    if weight.grad is None:
        weight.grad = torch.zeros((), dtype=weight.dtype, device=weight.device).expand_as(weight)


def _prepare(module: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Make ``module``'s parameters look as one outstanding entry would leave them (module
    docstring); returns the ``.grad`` values set aside, to add back after the call."""
    kept: list[tuple[nn.Parameter, torch.Tensor]] = []

    def set_aside(param: nn.Parameter) -> None:
        if param.grad is not None:
            kept.append((param, param.grad))
            param.grad = None

    fused = bool(getattr(module, "fuse_wgrad_accumulation", False))
    for weight in te_weights(module):
        if not weight.requires_grad:
            continue
        if not fused:
            set_aside(weight)
        elif hasattr(weight, "grad_added_to_main_grad"):
            _zero_placeholder_for_hook(weight)
            weight.grad_added_to_main_grad = True
    fp8 = bool(getattr(module, "fp8", False))
    for bias in te_biases(module):
        if bias.requires_grad:
            _zero_grad_for_hook(bias) if fp8 else set_aside(bias)
    return kept


@contextlib.contextmanager
def exactly(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run the block's ``backward_dw()`` calls of the TE layers ``modules`` (one each) with
    autograd's accumulation rule on every TE release (docs/megatron.md)."""
    kept = [pair for module in modules for pair in _prepare(module)]
    try:
        yield
    finally:
        for param, grad in kept:
            param.grad = grad if param.grad is None else param.grad + grad


def exact_backward_dw(module: nn.Module) -> None:
    """One ``module.backward_dw()``, exact on every supported TE release."""
    with exactly([module]):
        module.backward_dw()
