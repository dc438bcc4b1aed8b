"""A CPU stand-in for Transformer Engine's ``make_graphed_callables`` with ``_order``,
following ``transformer_engine/pytorch/graph.py``'s ``_make_graphed_callables`` (TE 2.17;
wgrad entries since 2.11): the same
checks of ``_order`` (dimensions, ``_num_layers_per_chunk`` of 1 with wgrad entries, a
forward only as an ``int``, the count-based wgrad validation), the same capture walk
(per-chunk forward and backward counters; a wgrad entry captures the wgrad graph of the
chunk's latest backward, ``bwd_idx - 1``), and graphed callables whose replays are recorded
(a wgrad graph never captured fails on replay, as a CUDA graph replayed without a capture
does). "Capturing" records the graph; replay runs the layer eagerly on the given input: a
plain module on its one input, a Megatron layer as TE's capture ran it (its
``_te_cuda_graph_capture`` with Megatron's capture flag up, on the replay's arguments,
``is_first_microbatch`` being TE's own), its backward through autograd as TE's graphed
function hands the parameters' gradients back.

Static buffers, as TE's ``Graphed`` autograd function hands them out: a replay's outputs are
views of the graph's static output buffers (``o.detach()``), its backward's input gradients
views of its static grad-input buffers. With ``_reuse_graph_input_output_buffers`` (TE 2.7
and later; Megatron passes it from TE 2.7 on) TE hands buffers back to the graph pool during
capture (``_make_graphed_callables``): a graph's static outputs right after its backward
graph is captured; the static grad inputs of the previous backward graph of the same
order entry; those of the previous entry's first layer at the next entry's first layer.
Memory handed back at capture position p may be written by any graph captured after p: the
stand-in fills every handed-back buffer with NaN when a graph captured after its hand-back
replays (after that replay read its own inputs), so a later read of it shows."""

from __future__ import annotations

from math import ceil
from typing import Any

import torch
from torch import nn


class StandInTE:
    """``make_graphed_callables`` (call the instance) and what it captured and replayed."""

    def __init__(self) -> None:
        self.captured: list[tuple[str, int]] = []
        self.replayed: list[tuple[str, int]] = []
        #: (capture position, "outputs" or "grad_inputs", graph) of each buffer handed back.
        self.handed_back: list[tuple[int, str, int]] = []
        self._statics: dict[tuple[str, int], list[torch.Tensor]] = {}

    def static(self, what: str, graph: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """``values`` written into graph ``graph``'s static ``what`` buffers (made at the
        first write); the buffers' views, as TE hands them out."""
        buffers = self._statics.get((what, graph))
        if buffers is None:
            buffers = self._statics[(what, graph)] = [torch.empty_like(v) for v in values]
        for buffer, value in zip(buffers, values, strict=True):
            buffer.copy_(value.detach())
        return [b.detach() for b in buffers]

    def replaying(self, kind: str, graph: int) -> None:
        """Graph ``graph``'s ``kind`` pass replays (after reading its inputs): every buffer
        handed back before its capture position is written over."""
        position = self.captured.index((kind, graph))
        for handed, what, owner in self.handed_back:
            if handed < position:
                for buffer in self._statics.get((what, owner), []):
                    if buffer.is_floating_point():
                        buffer.fill_(float("nan"))

    def __call__(
        self,
        callables: tuple[nn.Module, ...],
        sample_args: list[tuple[torch.Tensor, ...]],
        *,
        _order: list[float],
        _num_layers_per_chunk: list[int] | None = None,
        _reuse_graph_input_output_buffers: bool = False,
        **_: Any,
    ) -> list[Any]:
        reuse = _reuse_graph_input_output_buffers
        order = list(_order)
        without_wgrad = [c for c in order if ceil(c) == c]
        wgrad = len(without_wgrad) != len(order)
        chunks = max(without_wgrad)
        per_chunk = len(without_wgrad) // chunks // 2
        if chunks * per_chunk * 2 != len(without_wgrad):
            raise ValueError("Pipeline-parallel order dimension mismatch")
        layers = _num_layers_per_chunk or [len(callables) // chunks] * chunks
        if wgrad and any(n != 1 for n in layers):
            raise ValueError("Each model chunk must have only one layer when delay_wgrad_compute")
        if len(sample_args) != sum(layers) * per_chunk:
            raise ValueError(f"Expected {sum(layers) * per_chunk} args tuple")
        prefix = [sum(layers[:c]) for c in range(chunks)]
        fwd, bwd = [0] * chunks, [0] * chunks
        wgrad_captured: set[int] = set()
        previous_chunk_last = None
        for i, c_id in enumerate(order):
            if c_id > 0:
                if not isinstance(c_id, int):
                    raise TypeError("Forward order value must be an integer")
                m = c_id - 1
                for layer in range(layers[m]):
                    self.captured.append(("F", prefix[m] * per_chunk + fwd[m] * layers[m] + layer))
                fwd[m] += 1
                continue
            m = -ceil(c_id) - 1
            previous = None
            for layer in reversed(range(layers[m])):
                index = prefix[m] * per_chunk + bwd[m] * layers[m] + layer
                if ceil(c_id) != c_id:  # TE: per_callable_bwd_idx -= layers; no bwd_idx step
                    self.captured.append(("W", index - layers[m]))
                    wgrad_captured.add(index - layers[m])
                    continue
                if wgrad:
                    _validate_wgrad(order, i, c_id)
                self.captured.append(("B", index))
                if reuse:  # TE's weak references after this backward graph's capture
                    at = len(self.captured) - 1
                    self.handed_back.append((at, "outputs", index))
                    if previous is not None:
                        self.handed_back.append((at, "grad_inputs", previous))
                    previous = index
                    if layer == 0:
                        if previous_chunk_last is not None:
                            self.handed_back.append((at, "grad_inputs", previous_chunk_last))
                        previous_chunk_last = index
            if ceil(c_id) == c_id:
                bwd[m] += 1
        return [
            (_LayerGraphed if hasattr(callables[0], "_te_cuda_graph_capture") else _Graphed)(
                self,
                callables[_callable_of(g, prefix, layers, per_chunk)],
                g,
                wgrad,
                g in wgrad_captured,
            )
            for g in range(len(sample_args))
        ]


def _callable_of(graph: int, prefix: list[int], layers: list[int], per_chunk: int) -> int:
    """The callable a per-(layer, micro-batch) graph index belongs to (TE's layout)."""
    for m in reversed(range(len(prefix))):
        start = prefix[m] * per_chunk
        if graph >= start:
            return prefix[m] + (graph - start) % layers[m]
    raise IndexError(graph)


def _validate_wgrad(order: list[float], i: int, c_id: float) -> None:
    """TE's check of a dgrad entry: as many wgrad entries of the chunk follow as dgrads,
    counted from ``i`` until they balance ("Number of wgrad graph ... doesn't match")."""
    same, wgrads = 1, 0
    for entry in order[i + 1 :]:
        if entry > 0:
            continue
        same += entry == c_id
        wgrads += entry + 0.5 == c_id
        if same == wgrads:
            return
        if same < wgrads:
            break
    raise RuntimeError(f"Number of wgrad graph({wgrads}) doesn't match dgrad ({same})")


class _Graphed:
    """One (layer, micro-batch) graph: forward, backward and ``backward_dw`` replays."""

    def __init__(self, te: StandInTE, module: nn.Module, index: int, wgrad: bool, dw: bool):
        self.te, self.module, self.index, self.wgrad, self.dw_captured = (
            te,
            module,
            index,
            wgrad,
            dw,
        )
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _Replay.apply(self, x)

    def backward_dw(self) -> None:
        if not self.dw_captured:
            raise RuntimeError(f"replay of wgrad graph {self.index}, never captured")
        self.te.replayed.append(("W", self.index))
        out, grad = self._pending
        params = list(self.module.parameters())
        for p, g in zip(params, torch.autograd.grad(out, params, grad), strict=True):
            p.grad = g if p.grad is None else p.grad + g
        self._pending = None


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, graphed: _Graphed, x: torch.Tensor) -> torch.Tensor:
        te, index = graphed.te, graphed.index
        te.replayed.append(("F", index))
        inp = x.detach().clone().requires_grad_()  # TE copies into the static input
        te.replaying("F", index)
        with torch.enable_grad():
            out = graphed.module(inp)
        ctx.graphed, ctx.saved = graphed, (inp, out)
        return te.static("outputs", index, [out])[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        graphed = ctx.graphed
        te, index = graphed.te, graphed.index
        te.replayed.append(("B", index))
        grad = grad.clone()  # TE copies into the static grad output
        te.replaying("B", index)
        inp, out = ctx.saved
        params = [] if graphed.wgrad else list(graphed.module.parameters())
        grads = torch.autograd.grad(out, [inp, *params], grad, retain_graph=graphed.wgrad)
        for p, g in zip(params, grads[1:], strict=True):
            p.grad = g if p.grad is None else p.grad + g
        if graphed.wgrad:
            graphed._pending = (out, grad)
        return None, te.static("grad_inputs", index, [grads[0]])[0]


class _LayerGraphed(_Graphed):
    """One (Megatron layer, micro-batch) graph: a replay runs the layer's captured part on
    copies of its arguments (TE's static inputs), its backward through autograd."""

    def __call__(self, *args: Any, is_first_microbatch: bool | None = None, **kwargs: Any) -> Any:
        return _LayerReplay.apply(self, kwargs, *args)


class _LayerReplay(torch.autograd.Function):
    """A Megatron layer's graph replayed: outputs and input gradients are views of the
    graph's static buffers (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, graphed: _Graphed, kwargs: dict, *args: Any) -> tuple[Any, ...]:
        from megatron.core.transformer import cuda_graphs

        te, index = graphed.te, graphed.index
        te.replayed.append(("F", index))
        inputs = [
            a.detach().clone().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a
            for a in args
        ]
        te.replaying("F", index)
        cuda_graphs._set_capture_start()
        try:
            with torch.enable_grad():
                outputs = graphed.module._te_cuda_graph_capture(*inputs, **kwargs)
        finally:
            cuda_graphs._set_capture_end()
        ctx.graphed, ctx.inputs, ctx.outputs = graphed, inputs, outputs
        views = te.static("outputs", index, list(outputs))
        ctx.mark_non_differentiable(*[v for v in views if not v.is_floating_point()])
        return tuple(views)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        graphed = ctx.graphed
        te, index = graphed.te, graphed.index
        te.replayed.append(("B", index))
        grads = tuple(None if g is None else g.clone() for g in grads)
        te.replaying("B", index)
        pairs = [
            (o, torch.zeros_like(o) if g is None else g)
            for o, g in zip(ctx.outputs, grads, strict=True)
            if o.requires_grad
        ]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        needed = [a for a in ctx.inputs if torch.is_tensor(a) and a.requires_grad]
        views = iter(te.static("grad_inputs", index, [a.grad for a in needed]))
        return (
            None,
            None,
            *[next(views) if torch.is_tensor(a) and a.requires_grad else None for a in ctx.inputs],
        )
