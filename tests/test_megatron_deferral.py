"""dW deferral on Megatron's own linear layers gives the gradients of a plain backward.

Every case runs in forked gloo workers (megatron's process groups need a default group),
builds a tiny GPT twice from the same weights (dense with biases, or MoE with 4 experts,
top-2, SequentialMLP, no biases), and compares gradients by parameter name. A deferred run
forwards every micro-batch under ``store.active()``, runs B (``store.capture``) for all
but the last, a full backward (BW) for the last, and then the W actions in order. Relative
error of a tensor: max|a - b| / max|b|, bound 1e-5 (fp32).
"""

from __future__ import annotations

import functools
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_dualpipe.megatron.grads import deferral
from megatron_dualpipe.megatron.grads.deferral import (
    DeferrableColumnParallelLinear,
    DeferrableRowParallelLinear,
    WeightGradDeferralError,
    ddp_config_for_deferral,
    enable_weight_grad_deferral,
    with_delay_wgrad_compute,
)
from megatron_dualpipe.runtime import DeferrableLayer, WeightGradStore
from tests import tiny_models as tm
from tests.megatron_harness import CPU_ONLY
from tests.multiproc import run_workers

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc, CPU_ONLY]

REL_TOL = 1e-5
NUM_LAYERS = 2
MICRO_BATCH_SIZE = 2
NUM_MICROBATCHES = 3
INIT_SEED = 1234
DATA_SEED = 7
TIMEOUT_MIN = 0.1
PG_TIMEOUT_S = 6.0
RUN_TIMEOUT_S = 60.0
# Small DDP buckets: several buckets, so overlap_grad_reduce dispatches bucket by bucket.
BUCKET_SIZE = 20_000
# Linear layers per tiny model: qkv, proj, fc1, fc2 per dense layer; qkv, proj and
# 4 experts x (fc1, fc2) per MoE layer; plus the output layer.
CONVERTED = {False: 4 * NUM_LAYERS + 1, True: 10 * NUM_LAYERS + 1}


# --------------------------------------------------------------------------------------
# Helpers (run inside the workers).


def _init_parallel(tp: int = 1) -> None:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, distributed_timeout_minutes=TIMEOUT_MIN
    )
    megatron_random.model_parallel_cuda_manual_seed(INIT_SEED)


def _config(moe: bool, tp: int = 1) -> Any:
    experts = {"num_moe_experts": 4, "moe_router_topk": 2} if moe else {}
    return tm.tiny_gpt_config(num_layers=NUM_LAYERS, tensor_model_parallel_size=tp, **experts)


def _twins(config: Any, count: int) -> list[torch.nn.Module]:
    """``count`` models with the same weights.

    MoE with TP > 1 runs in eval mode: MoELayer refuses TP without sequence parallelism in
    training mode (``MoELayer.forward``) and the local spec's torch LayerNorm refuses
    sequence parallelism (``WrappedTorchNorm.__new__``); dropout is 0, so the computation is
    the same.
    """
    torch.manual_seed(INIT_SEED)
    first = tm.build_reference_gpt(config)
    state = tm.global_state(first)
    models = [first]
    for _ in range(count - 1):
        model = tm.build_reference_gpt(config)
        tm.load_global_state(model, state)
        models.append(model)
    if config.num_moe_experts and config.tensor_model_parallel_size > 1:
        for model in models:
            model.eval()
    return models


def _data(num: int = NUM_MICROBATCHES, seed: int = DATA_SEED) -> list[dict[str, torch.Tensor]]:
    return tm.synthetic_microbatches(num, micro_batch_size=MICRO_BATCH_SIZE, seed=seed)


def _loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], n: int) -> torch.Tensor:
    """The micro-batch's masked mean token loss over ``n`` (Megatron's schedule scaling)."""
    per_token = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    mask = batch["loss_mask"]
    return (per_token.float() * mask).sum() / mask.sum() / n


def _deferred_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [
        p
        for m in model.modules()
        if isinstance(m, DeferrableLayer)
        for p in m.deferred_parameters()
    ]


def _other_grads_present(model: torch.nn.Module, deferred: Sequence[torch.nn.Parameter]) -> bool:
    """Every parameter outside ``deferred`` that takes part has its gradient (MoE experts
    can see no token; router and expert weights are checked through the whole run)."""
    ids = {id(p) for p in deferred}
    return all(
        p.grad is not None
        for n, p in model.named_parameters()
        if id(p) not in ids and "experts" not in n
    )


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


def _max_err(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> float:
    """Worst relative error by name; both must name the same parameters."""
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    return max(_rel_err(actual[name], expected[name]) for name in expected)


# --------------------------------------------------------------------------------------
# Workers.


def _split_run(model: torch.nn.Module, store: WeightGradStore) -> dict[str, Any]:
    """F for every micro-batch, B for all but the last, BW for the last, then the Ws."""
    batches = _data()
    with store.active():
        losses = [_loss(model, batch, len(batches)) for batch in batches]
    deferred = _deferred_weights(model)
    for key, loss in enumerate(losses[:-1]):
        with store.capture(key):
            loss.backward()
    after_b = {
        "deferred_absent": all(p.grad is None for p in deferred),
        "others_present": _other_grads_present(model, deferred),
        "queued": len(store),
    }
    losses[-1].backward()  # BW: the store is not capturing
    for key in range(len(losses) - 1):
        store.run(key)
    after_b["deferred_present_after_w"] = all(p.grad is not None for p in deferred)
    return after_b


def _equivalence_worker(rank: int, world_size: int, moe: bool) -> dict[str, Any]:
    """Plain backward vs B/BW/W on a converted twin, vs a converted twin without a store,
    vs an unconverted twin under the store."""
    _init_parallel(tp=world_size)
    try:
        config = _config(moe, tp=world_size)
        plain, deferred, no_store, untouched = _twins(config, 4)
        tm.run_reference_step(plain, _data())
        expected = tm.global_gradients(plain)

        converted = enable_weight_grad_deferral([deferred])
        again = enable_weight_grad_deferral(deferred)
        split = _split_run(deferred, WeightGradStore())

        enable_weight_grad_deferral(no_store)
        tm.run_reference_step(no_store, _data())

        untouched_split = _split_run(untouched, WeightGradStore())

        torch.manual_seed(INIT_SEED)
        from_spec = tm.build_reference_gpt(config, deferrable=True)
        tm.load_global_state(from_spec, tm.global_state(untouched))
        if config.num_moe_experts and config.tensor_model_parallel_size > 1:
            from_spec.eval()
        built_deferrable = sum(isinstance(m, DeferrableLayer) for m in from_spec.modules())
        from_spec_converted = enable_weight_grad_deferral(from_spec)
        _split_run(from_spec, WeightGradStore())
        return {
            "built_deferrable": built_deferrable,
            "from_spec_converted": from_spec_converted,
            "err_from_spec": _max_err(tm.global_gradients(from_spec), expected),
            "converted": converted,
            "again": again,
            "types": sorted(
                {type(m).__name__ for m in deferred.modules() if "Linear" in type(m).__name__}
            ),
            "untouched_types": sorted(
                {type(m).__name__ for m in untouched.modules() if "Linear" in type(m).__name__}
            ),
            "split": split,
            "untouched_split": untouched_split,
            "err_deferred": _max_err(tm.global_gradients(deferred), expected),
            "err_no_store": _max_err(tm.global_gradients(no_store), expected),
            "err_untouched": _max_err(tm.global_gradients(untouched), expected),
            "nonzero": all(g.abs().max() > 0 for g in expected.values()),
        }
    finally:
        parallel_state.destroy_model_parallel()


def _counting_ddp(
    config: Any, ddp_config: DistributedDataParallelConfig, model: torch.nn.Module
) -> tuple[DistributedDataParallel, Counter[str]]:
    """Megatron DDP around ``model`` whose grad-ready hooks count their calls by name."""
    fired: Counter[str] = Counter()
    names = {p: n for n, p in tm.global_named_parameters(model).items()}
    original = DistributedDataParallel._make_backward_post_hook

    def make_hook(self: DistributedDataParallel, param: torch.nn.Parameter) -> Any:
        hook = original(self, param)

        def counted(*args: Any) -> None:
            fired[names[param]] += 1
            hook(*args)

        return counted

    DistributedDataParallel._make_backward_post_hook = make_hook  # type: ignore[method-assign]
    try:
        return DistributedDataParallel(config, ddp_config, model), fired
    finally:
        DistributedDataParallel._make_backward_post_hook = original  # type: ignore[method-assign]


def _ddp_worker(rank: int, world_size: int, overlap: bool) -> dict[str, Any]:
    """DP=2, two steps of two micro-batches each (no_sync around the first): plain
    Megatron DDP vs deferral (F0, B0 under no_sync, F1, B1, W0, W1)."""
    _init_parallel()
    try:
        config = _config(moe=False)
        plain, deferred = _twins(config, 2)
        converted = enable_weight_grad_deferral(deferred)
        plain_ddp, plain_fired = _counting_ddp(
            config,
            DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=BUCKET_SIZE),
            plain,
        )
        ddp, fired = _counting_ddp(
            config,
            ddp_config_for_deferral(overlap_grad_reduce=overlap, bucket_size=BUCKET_SIZE),
            deferred,
        )
        deferred_names = [
            n
            for n, p in tm.global_named_parameters(deferred).items()
            if getattr(p, "skip_backward_post_hook", False)
        ]
        batches = _data(2, seed=DATA_SEED + parallel_state.get_data_parallel_rank())
        store = WeightGradStore()
        steps = []
        for _ in range(2):
            plain_ddp.zero_grad_buffer()
            ddp.zero_grad_buffer()
            plain_fired.clear()
            fired.clear()
            with plain_ddp.no_sync():
                _loss(plain_ddp, batches[0], 2).backward()
            _loss(plain_ddp, batches[1], 2).backward()
            plain_ddp.finish_grad_sync()

            with store.active():
                loss0 = _loss(ddp, batches[0], 2)
            with ddp.no_sync(), store.capture(0):
                loss0.backward()
            after_b = tm.global_gradients(ddp)
            with store.active():
                loss1 = _loss(ddp, batches[1], 2)
            with store.capture(1):
                loss1.backward()
            store.run(0)
            store.run(1)
            ddp.finish_grad_sync()
            steps.append(
                {
                    "err": _max_err(tm.global_gradients(ddp), tm.global_gradients(plain_ddp)),
                    "deferred_zero_after_b": all(not after_b[n].any() for n in deferred_names),
                    "others_after_b": all(
                        after_b[n].any() for n in after_b if n not in deferred_names
                    ),
                    "fired": dict(fired),
                    "plain_fired": dict(plain_fired),
                }
            )
        return {
            "converted": converted,
            "num_deferred": len(deferred_names),
            "params": sorted(tm.global_named_parameters(deferred)),
            "steps": steps,
        }
    finally:
        parallel_state.destroy_model_parallel()


class _UsedTwice(torch.nn.Module):
    """One Megatron linear layer used twice per micro-batch, as the output layer serves the
    main head and the MTP block's."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.linear = ColumnParallelLinear(
            16, 16, config=config, init_method=torch.nn.init.normal_, bias=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, _ = self.linear(x)
        second, _ = self.linear(x.flip(0) * 3.0 - 1.0)
        return (first * second).sum()


def _used_twice_worker(rank: int, world_size: int) -> bool:
    """Two micro-batches through Megatron DDP, plain and deferred (F0 B0 F1 B1 W0 W1):
    whether the ``main_grad`` buffers are bit for bit equal."""
    _init_parallel()
    try:
        config = _config(moe=False)
        torch.manual_seed(INIT_SEED)
        plain, deferred = _UsedTwice(config), _UsedTwice(config)
        deferred.load_state_dict(plain.state_dict())
        assert enable_weight_grad_deferral(deferred) == 1
        plain_ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), plain)
        ddp = DistributedDataParallel(config, ddp_config_for_deferral(), deferred)
        generator = torch.Generator().manual_seed(DATA_SEED)
        inputs = [torch.randn(5, 3, 16, generator=generator) for _ in range(2)]
        for x in inputs:
            plain_ddp(x).backward()
        store = WeightGradStore()
        for key, x in enumerate(inputs):
            with store.active():
                loss = ddp(x)
            with store.capture(key):
                loss.backward()
        for key in range(len(inputs)):
            store.run(key)
        return torch.equal(
            deferred.linear.weight.main_grad, plain.linear.weight.main_grad
        ) and bool(plain.linear.weight.main_grad.any())
    finally:
        parallel_state.destroy_model_parallel()


def _refusal_worker(rank: int, world_size: int) -> dict[str, str]:
    """The order mistakes around DDP, each caught with its message."""
    _init_parallel()
    try:
        config = _config(moe=False)
        messages = {}
        wrapped_first = DistributedDataParallel(
            config, DistributedDataParallelConfig(), _twins(config, 1)[0]
        )
        try:
            enable_weight_grad_deferral(wrapped_first)
        except WeightGradDeferralError as error:
            messages["enable_after_ddp"] = str(error)
        model = _twins(config, 1)[0]
        enable_weight_grad_deferral(model)
        no_delay = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        try:
            _loss(no_delay, _data(1)[0], 1)
        except WeightGradDeferralError as error:
            messages["ddp_without_delay"] = str(error)
        return messages
    finally:
        parallel_state.destroy_model_parallel()


def _sp_block(config: Any) -> list[torch.nn.Module]:
    """ColumnParallelLinear -> RowParallelLinear with biases, as in Megatron's MLP."""
    init = functools.partial(torch.nn.init.normal_, std=0.02)
    hidden = config.hidden_size
    column = ColumnParallelLinear(
        hidden, 4 * hidden, config=config, init_method=init, bias=True, gather_output=False
    )
    row = RowParallelLinear(
        4 * hidden,
        hidden,
        config=config,
        init_method=init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    )
    with torch.no_grad():  # biases start at zero: make their gradient path visible
        column.bias.normal_()
        row.bias.normal_()
    return [column, row]


def _sp_mlp(config: Any) -> torch.nn.ModuleList:
    """Two blocks: the second column layer's deferred dW must survive the first one's
    all-gather in the same backward (Megatron's shared gather buffer)."""
    torch.manual_seed(INIT_SEED)
    return torch.nn.ModuleList(_sp_block(config) + _sp_block(config))


def _sp_backward(mlp: torch.nn.ModuleList, hidden: torch.Tensor) -> torch.Tensor:
    for column, row in zip(mlp[::2], mlp[1::2], strict=True):
        hidden, _ = row(torch.nn.functional.gelu(column(hidden)[0]))
    return hidden.square().sum()


def _sequence_parallel_worker(rank: int, world_size: int) -> dict[str, Any]:
    """TP=2 with sequence parallelism (input all-gather, dX reduce-scatter) on a bare
    Column -> Row MLP: the local spec's LayerNorm refuses sequence parallelism on CPU."""
    _init_parallel(tp=world_size)
    try:
        config = tm.tiny_gpt_config(
            num_layers=NUM_LAYERS, tensor_model_parallel_size=world_size, sequence_parallel=True
        )
        plain, deferred = _sp_mlp(config), _sp_mlp(config)
        enable_weight_grad_deferral(deferred)
        torch.manual_seed(DATA_SEED + rank)
        x = torch.randn(tm.SEQ_LENGTH // world_size, MICRO_BATCH_SIZE, config.hidden_size)
        x_plain, x_deferred = x.clone().requires_grad_(), x.clone().requires_grad_()
        _sp_backward(plain, x_plain).backward()

        store = WeightGradStore()
        with store.active():
            loss = _sp_backward(deferred, x_deferred)
        with store.capture(0):
            loss.backward()
        deferred_absent = all(m.weight.grad is None for m in deferred)
        bias_present = all(m.bias.grad is not None for m in deferred)
        store.run(0)
        expected = {n: p.grad for n, p in plain.named_parameters()} | {"x": x_plain.grad}
        actual = {n: p.grad for n, p in deferred.named_parameters()} | {"x": x_deferred.grad}
        return {
            "types": [type(m).__name__ for m in deferred],
            "deferred_absent": deferred_absent,
            "bias_present": bias_present,
            "err": _max_err(actual, expected),
        }
    finally:
        parallel_state.destroy_model_parallel()


# --------------------------------------------------------------------------------------
# Tests.


@functools.cache
def _equivalence(world_size: int, moe: bool) -> dict[str, Any]:
    results = run_workers(
        _equivalence_worker,
        world_size,
        args=(moe,),
        timeout_s=RUN_TIMEOUT_S,
        pg_timeout_s=PG_TIMEOUT_S,
    )
    worst = {
        key: max(r[key] for r in results)
        for key in ("err_deferred", "err_no_store", "err_untouched", "err_from_spec")
    }
    print(f"\nTP={world_size} moe={moe}: max relative errors {worst}")
    return {"ranks": results, **worst}


CASES = [
    pytest.param(1, False, id="dense-tp1", marks=pytest.mark.slow),
    pytest.param(1, True, id="moe-tp1", marks=pytest.mark.slow),
    pytest.param(2, False, id="dense-tp2"),
    pytest.param(2, True, id="moe-tp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("world_size", "moe"), CASES)
def test_deferred_gradients_match_plain_backward(world_size: int, moe: bool) -> None:
    result = _equivalence(world_size, moe)
    assert result["err_deferred"] <= REL_TOL
    for rank in result["ranks"]:
        assert rank["nonzero"], "a reference gradient is all zero: the check has no teeth"
        assert rank["converted"] == rank["again"] == CONVERTED[moe]
        assert rank["types"] == ["DeferrableColumnParallelLinear", "DeferrableRowParallelLinear"]


@pytest.mark.parametrize(("world_size", "moe"), CASES)
def test_a_model_built_from_the_deferrable_spec_needs_no_class_switch(
    world_size: int, moe: bool
) -> None:
    """Megatron's own layer spec with our classes: every linear layer of the transformer
    layers defers from construction; only GPTModel's output layer (outside the spec) is
    converted afterwards; the gradients are those of a plain backward."""
    result = _equivalence(world_size, moe)
    assert result["err_from_spec"] <= REL_TOL
    for rank in result["ranks"]:
        assert rank["built_deferrable"] == CONVERTED[moe] - 1
        assert rank["from_spec_converted"] == CONVERTED[moe]


@pytest.mark.parametrize(("world_size", "moe"), CASES)
def test_weight_grad_is_absent_after_b_and_present_after_w(world_size: int, moe: bool) -> None:
    for rank in _equivalence(world_size, moe)["ranks"]:
        split = rank["split"]
        assert split["queued"] == NUM_MICROBATCHES - 1
        assert split["deferred_absent"], "a deferred weight has a gradient after B"
        assert split["others_present"], "a non-deferred parameter lacks its gradient after B"
        assert split["deferred_present_after_w"]


@pytest.mark.parametrize(("world_size", "moe"), CASES)
def test_without_store_or_without_conversion_nothing_changes(world_size: int, moe: bool) -> None:
    result = _equivalence(world_size, moe)
    # A converted layer with no store computes what Megatron computes, in the same order.
    assert result["err_no_store"] == 0.0
    # Unconverted layers under an active, capturing store: nothing is deferred.
    assert result["err_untouched"] == 0.0
    for rank in result["ranks"]:
        assert rank["untouched_types"] == ["ColumnParallelLinear", "RowParallelLinear"]
        assert rank["untouched_split"]["others_present"]
    assert ColumnParallelLinear._forward_impl is not DeferrableColumnParallelLinear._forward_impl
    assert RowParallelLinear._forward_impl is not DeferrableRowParallelLinear._forward_impl


def test_sequence_parallel_tp2_mlp_matches_plain_backward() -> None:
    results = run_workers(
        _sequence_parallel_worker, 2, timeout_s=RUN_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S
    )
    for result in results:
        assert (
            result["types"] == ["DeferrableColumnParallelLinear", "DeferrableRowParallelLinear"] * 2
        )
        assert result["deferred_absent"] and result["bias_present"]
        assert result["err"] <= REL_TOL
    print(f"\nTP=2 sequence parallel MLP: max relative error {max(r['err'] for r in results):.2e}")


@pytest.mark.parametrize(
    "overlap",
    [
        pytest.param(False, id="sync-reduce", marks=pytest.mark.slow),
        pytest.param(True, id="overlap-grad-reduce"),
    ],
)
def test_megatron_ddp_reduces_deferred_gradients(overlap: bool) -> None:
    results = run_workers(
        _ddp_worker, 2, args=(overlap,), timeout_s=RUN_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S
    )
    worst = 0.0
    for result in results:
        assert result["converted"] == CONVERTED[False] == result["num_deferred"]
        for step in result["steps"]:
            worst = max(worst, step["err"])
            assert step["err"] <= REL_TOL
            assert step["deferred_zero_after_b"], "main_grad of a deferred weight moved in B"
            assert step["others_after_b"]
            expected = dict.fromkeys(result["params"], 2)  # once per param per micro-batch
            assert step["plain_fired"] == expected
            assert step["fired"] == expected
    print(f"\nDDP overlap_grad_reduce={overlap}: max relative error {worst:.2e}")


def test_a_layer_used_twice_per_micro_batch_sums_as_autograd_does() -> None:
    """Both deferred dWs of a layer used twice in one micro-batch are summed in its
    ``.grad`` before DDP's hook adds them to ``main_grad``, as autograd sums them: the
    same bits (added one by one, the second micro-batch rounded differently)."""
    assert run_workers(
        _used_twice_worker, 1, timeout_s=RUN_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S
    ) == [True]


def test_order_mistakes_around_ddp_are_refused() -> None:
    (messages,) = run_workers(_refusal_worker, 1, timeout_s=RUN_TIMEOUT_S)
    assert "before wrapping" in messages["enable_after_ddp"]
    assert "ddp_config_for_deferral" in messages["ddp_without_delay"]


def test_config_helpers() -> None:
    ddp_config = ddp_config_for_deferral(overlap_grad_reduce=True)
    assert ddp_config.delay_wgrad_compute and ddp_config.overlap_grad_reduce
    with pytest.raises(WeightGradDeferralError):
        ddp_config_for_deferral(delay_wgrad_compute=False)
    with pytest.raises(WeightGradDeferralError):
        ddp_config_for_deferral(use_megatron_fsdp=True)
    config = tm.tiny_gpt_config(num_layers=NUM_LAYERS)
    te_config = with_delay_wgrad_compute(config)
    assert te_config.delay_wgrad_compute and not config.delay_wgrad_compute


# --------------------------------------------------------------------------------------
# The TE path, on a stand-in: a module that behaves as TE's delay_wgrad_compute contract
# says (every backward queues one dW entry, backward_dw() pops the oldest, assigns .grad and
# fires the registered hooks), so the B/BW/W routing is checked without TE or CUDA.


class _QueueingLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, module: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module = module
        return x.matmul(weight.t())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        ctx.module.entries.append((x, grad))
        return grad.matmul(weight), None, None


class _StandInTELinear(torch.nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(size, size) / size**0.5)
        self.config = SimpleNamespace(delay_wgrad_compute=True)
        self.entries: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        self.wgrad_accumulation_and_reduce_hooks: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QueueingLinearFunction.apply(x, self.weight, self)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Any) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def backward_dw(self) -> None:
        x, grad = self.entries.popleft()
        self.weight.grad = grad.t().matmul(x)
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


@pytest.fixture
def stand_in_te(monkeypatch: pytest.MonkeyPatch) -> type[_StandInTELinear]:
    monkeypatch.setattr(deferral, "_te_layer_classes", lambda: (_StandInTELinear,))
    monkeypatch.setattr(deferral, "_check_te_version", lambda: None)
    return _StandInTELinear


def _stand_in_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(_StandInTELinear(6), torch.nn.Tanh(), _StandInTELinear(6))


def test_te_layers_run_backward_dw_in_w_or_at_once_in_bw(stand_in_te: type) -> None:
    model = _stand_in_model()
    plain = torch.nn.Sequential(torch.nn.Linear(6, 6, bias=False), torch.nn.Tanh())
    plain.append(torch.nn.Linear(6, 6, bias=False))
    with torch.no_grad():
        plain[0].weight.copy_(model[0].weight)
        plain[2].weight.copy_(model[2].weight)
    inputs = [torch.randn(4, 6, requires_grad=True) for _ in range(3)]
    for x in inputs:
        plain(x).square().sum().backward()

    assert enable_weight_grad_deferral(model) == 2 == enable_weight_grad_deferral(model)
    main_grads = [torch.zeros(6, 6), torch.zeros(6, 6)]
    fired = Counter()
    for index, layer in enumerate(model[::2]):  # what Megatron DDP's hook does

        def hook(index: int = index, layer: Any = layer) -> None:
            fired[index] += 1
            main_grads[index] += layer.weight.grad
            layer.weight.grad = None

        layer.register_wgrad_accumulation_and_reduce_hooks(hook)
    store = WeightGradStore()
    with store.active():
        losses = [model(x).square().sum() for x in inputs]
    for key, loss in enumerate(losses[:2]):
        with store.capture(key):
            loss.backward()
    assert not any(main_grads[i].any() for i in range(2)) and not fired
    assert [len(layer.entries) for layer in model[::2]] == [2, 2]
    losses[2].backward()  # BW: backward_dw at once (it pops the oldest entry: sums agree)
    assert dict(fired) == {0: 1, 1: 1}
    store.run(0)
    store.run(1)
    assert dict(fired) == {0: 3, 1: 3}
    assert [len(layer.entries) for layer in model[::2]] == [0, 0]
    for got, layer in zip(main_grads, plain[::2], strict=True):
        assert _rel_err(got, layer.weight.grad) <= REL_TOL


def test_te_misuse_is_refused(stand_in_te: type) -> None:
    model = _stand_in_model()
    enable_weight_grad_deferral(model)
    with pytest.raises(WeightGradDeferralError, match="require grad"):
        model(torch.randn(4, 6))
    with pytest.raises(WeightGradDeferralError, match="delay_wgrad_compute"):
        enable_weight_grad_deferral(_stand_in_model_without_delay())
    model[0].weight.main_grad = torch.zeros(6, 6)  # as Megatron DDP without delay leaves it
    with pytest.raises(WeightGradDeferralError, match="ddp_config_for_deferral"):
        model(torch.randn(4, 6, requires_grad=True))


def _stand_in_model_without_delay() -> torch.nn.Module:
    layer = _StandInTELinear(6)
    layer.config.delay_wgrad_compute = False
    return layer
