"""Contracts of the dX/dW split: the weight-gradient store and the deferrable linear."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megatron_dualpipe.runtime import (
    DeferrableLayer,
    DeferrableLinear,
    WeightGradStore,
    active_store,
    make_deferrable,
)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 7, bias=False), nn.LayerNorm(7), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3)
    )


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_make_deferrable_keeps_modules_and_parameters() -> None:
    model = _model()
    params = dict(model.named_parameters())
    linears = [model[0], model[2], model[4]]
    assert make_deferrable(model) == ["0", "2", "4"]
    assert [model[0], model[2], model[4]] == linears
    assert all(type(m) is DeferrableLinear for m in linears)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert isinstance(model[2], DeferrableLayer)
    assert list(model[2].deferred_parameters()) == [model[2].weight]


def test_without_an_active_store_it_is_an_ordinary_linear() -> None:
    plain = _model()
    deferred = copy.deepcopy(plain)
    make_deferrable(deferred)
    x = torch.randn(4, 3, 5, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    plain(x).square().sum().backward()
    deferred(x2).square().sum().backward()
    for (name, a), b in zip(_grads(plain).items(), _grads(deferred).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=name)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=0)


def test_capture_defers_weights_only_and_w_gives_identical_gradients() -> None:
    store = WeightGradStore()
    reference = _model()
    make_deferrable(reference)
    model = copy.deepcopy(reference)
    inputs = [torch.randn(2, 5) for _ in range(3)]
    for x in inputs:  # reference: ordinary backward, micro-batch after micro-batch
        reference(x).square().sum().backward()

    deferred = {
        id(p)
        for m in model.modules()
        if isinstance(m, DeferrableLayer)
        for p in m.deferred_parameters()
    }
    outs = []
    for x in inputs:
        with store.active():
            assert active_store() is store
            outs.append(model(x).square().sum())
    assert active_store() is None
    for mb, out in enumerate(outs):
        with store.capture(("stage", mb)):
            out.backward()
    # dX-time gradients: norms and biases yes, deferred weights not yet.
    for p in model.parameters():
        assert (p.grad is None) == (id(p) in deferred)
    assert len(store) == 3
    for mb in range(3):
        store.run(("stage", mb))
    assert len(store) == 0
    for (name, a), b in zip(_grads(reference).items(), _grads(model).values(), strict=True):
        assert torch.equal(a, b), name


def test_w_must_run_the_oldest_entry() -> None:
    store = WeightGradStore()
    with store.capture("a"):
        pass
    with store.capture("b"):
        pass
    with pytest.raises(RuntimeError, match="oldest deferred weight gradient is a"):
        store.run("b")
    store.run("a")
    store.run("b")
    with pytest.raises(RuntimeError, match="no deferred weight gradient is queued"):
        store.run("c")


def test_entry_keeps_its_owner_alive_until_w() -> None:
    store = WeightGradStore()
    released = []

    class Owner:
        def __del__(self) -> None:
            released.append(True)

    with store.capture("a", owner=Owner()):
        pass
    assert not released
    store.run("a")
    assert released == [True]


def test_defer_outside_a_capture_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no backward is being captured"):
        WeightGradStore().defer(lambda: None)


def test_w_of_different_stages_run_in_any_order_but_each_stage_in_b_order() -> None:
    store, done = WeightGradStore(), []
    for stage, mb in ((0, 0), (1, 0), (0, 1)):
        with store.capture((stage, mb), lane=stage):
            store.defer(lambda s=stage, m=mb: done.append((s, m)))
    store.run((1, 0), lane=1)  # stage 1 before stage 0's older entry: allowed
    with pytest.raises(RuntimeError, match="first-in first-out"):
        store.run((0, 1), lane=0)  # stage 0's newer entry first: refused
    store.run((0, 0), lane=0)
    store.run((0, 1), lane=0)
    assert done == [(1, 0), (0, 0), (0, 1)] and len(store) == 0


# -- slow: training --------------------------------------------------------------------
