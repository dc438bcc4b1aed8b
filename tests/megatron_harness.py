"""Shared harness of the multi-process Megatron tests: a pipelined training step under
any schedule (Megatron's own or ours) against a one-process, unpipelined reference run of
the same model on the same data.

Every rank loads the reference model's weights by global parameter name, runs one
training step with Megatron's schedule, and returns its losses and gradients by
global name; each is compared with the reference per parameter. Relative error of a
tensor is max|a - b| / max|b| (fp32, bound 1e-5). Megatron and torch are imported
here, once, so forked workers start in about a second; megatron's process groups use
a 6 s timeout so a deadlock fails fast.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron_dualpipe.megatron.compat.version import clean_mtp_tracker, mtp_tracker_fields
from megatron_dualpipe.megatron.grads.deferral import (
    ddp_config_for_deferral,
    enable_weight_grad_deferral,
)
from megatron_dualpipe.megatron.grads.mirror import prepare_mirrors
from megatron_dualpipe.megatron.model.names import global_named_parameters
from megatron_dualpipe.megatron.model.placement import StagePlacementLayout, embedding_ranks
from megatron_dualpipe.megatron.model.position_copies import (
    finalize_model_grads,
    mark_position_copies,
)
from megatron_dualpipe.megatron.model.tied import mark_tied_copies
from megatron_dualpipe.megatron.schedule.checks import pipeline_setup, schedule_spec
from megatron_dualpipe.megatron.schedule.registry import get_forward_backward_func
from megatron_dualpipe.runtime import WeightGradStore
from megatron_dualpipe.schedules.ir import Kind
from megatron_dualpipe.schedules.registry import generate
from tests import tiny_models as tm
from tests.digits import beyond
from tests.multiproc import run_workers

#: These tests run Megatron on CPU+gloo through the CPU compatibility layer (a no-op with CUDA).
CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU+gloo tests: apply_cpu_compat is a no-op with CUDA"
)
REL_TOL = 1e-5
FP32_EPS = float(torch.finfo(torch.float32).eps)
NUM_MICROBATCHES = 8
MICRO_BATCH_SIZE = 2
INIT_SEED = 1234
DATA_SEED = 99
#: The waits' bounds (times the ranks per core): long enough for a loaded CI machine (a
#: 12 s gloo send timed out in a clean-clone CI run), short enough that a hang fails.
TIMEOUT_MIN = 0.5
PG_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 60.0
#: More ranks than cores wait on one another longer: timeouts grow with ranks per core.
CORES = max(1, os.cpu_count() or 1)
#: Megatron DDP's bucket size in the tests (elements) and the most bytes one exchange of
#: dualpipe's mirror sum moves: both small, so that a tiny model's chunks fill several
#: buckets and slices, and a rank's two dualpipe stages different numbers of them (16 KiB:
#: the DeepSeek-shaped test model's stages are 59 and 48 slices, partial ones among them; at
#: 1 KiB they were 764 and 930 exchanges a step: one dualpipe case took 26 s, not 18).
BUCKET_ELEMENTS = 4096
MIRROR_SLICE_BYTES = 16 * 1024
# Optimizer check: SGD keeps the update linear in the gradient, so the 1e-5 bound on
# gradients carries over; the step moves every weight tensor by 1e-4 (layer norms) to
# 0.4 of its size, so a wrong update (unclipped, wrong group, missed parameter) shows
# above the 1e-5 bound. The clip threshold is below the gradient norm (~0.9).
LR = 10.0
MOMENTUM = 0.9
CLIP_GRAD = 0.05


@dataclass(frozen=True)
class Model:
    """What the model is, independent of how it is parallelised. ``deepseek``: DeepSeek-V3's
    structure in small (RMSNorm, SwiGLU, MLA; with ``moe``, a shared expert and sigmoid
    routing with expert bias and top-k scaling); ``dense_first``: that many dense layers
    before the MoE ones; ``mtp``: MTP layers."""

    moe: bool = False
    tied: bool = False
    rope: bool = False
    deepseek: bool = False
    dense_first: int = 0
    mtp: int | None = None
    num_layers: int = 8
    #: Biased linear layers (dense models; MoE ones never have biases).
    bias: bool = True

    def config(self, **parallel: Any) -> Any:
        features: dict[str, Any] = {"num_layers": self.num_layers, "mtp_num_layers": self.mtp}
        if not self.bias:
            features["add_bias_linear"] = False
        if self.moe:
            features.update(num_moe_experts=4, moe_router_topk=2)
            if self.dense_first:
                dense = self.dense_first
                features["moe_layer_freq"] = [0] * dense + [1] * (self.num_layers - dense)
        if self.deepseek:
            features.update(
                normalization="RMSNorm",
                gated_linear_unit=True,
                activation_func=F.silu,
                add_bias_linear=False,
                multi_latent_attention=True,
                q_lora_rank=32,
                kv_lora_rank=16,
                qk_head_dim=16,
                qk_pos_emb_head_dim=8,
                v_head_dim=16,
                rope_type="rope",
            )
            if self.moe:
                features.update(
                    moe_ffn_hidden_size=32,
                    moe_shared_expert_intermediate_size=32,
                    moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True,
                    moe_router_topk_scaling_factor=2.5,
                    moe_router_dtype="fp32",
                )
        return tm.tiny_gpt_config(**features, **parallel)

    def build_kwargs(self) -> dict[str, Any]:
        return {
            "share_embeddings_and_output_weights": self.tied,
            "position_embedding_type": "rope" if self.rope else "learned_absolute",
        }


@dataclass(frozen=True)
class Layout:
    """How one run is parallelised and which Megatron machinery it goes through.
    ``schedule`` None lets Megatron choose (1F1B, or interleaved with ``vp``)."""

    pp: int
    vp: int | None = None
    ep: int = 1
    dp: int = 1
    tp: int = 1
    ddp: bool = False
    overlap_grad_reduce: bool = False
    optimizer: bool = False
    dispatcher: str = "alltoall"
    batch_p2p_comm: bool = False
    schedule: str | None = None
    microbatches: int = NUM_MICROBATCHES
    #: Our schedules: Megatron's linear layers defer dW to the W actions.
    deferral: bool = True
    distributed_optimizer: bool = False
    #: Pass Megatron's explicit ``p2p_communicator`` and ``pg_collection`` to the schedule.
    explicit_groups: bool = False
    #: Megatron's split settings, read over the schedule's model stages in pipeline order.
    first: int | None = None
    last: int | None = None
    layout: str | None = None
    #: Megatron DDP's bucket size (elements); None: Megatron's default. Small by default,
    #: so that a chunk's gradients fill several buckets, as a real model's do.
    bucket_size: int | None = BUCKET_ELEMENTS
    #: Wrap chunks as Megatron-LM's ``get_model`` does (bucketing off from the second chunk
    #: on) instead of as megatron-dualpipe's ``train`` (also off for every dualpipe chunk).
    megatron_lm_bucketing: bool = False
    #: TransformerConfig's activation recomputation keys, as (key, value) pairs.
    recompute: tuple[tuple[str, Any], ...] = ()

    def split(self) -> dict[str, Any]:
        """The split as Megatron's TransformerConfig takes it, for Megatron's placement."""
        if self.layout is not None:
            return {"pipeline_model_parallel_layout": self.layout}
        return {
            "num_layers_in_first_pipeline_stage": self.first,
            "num_layers_in_last_pipeline_stage": self.last,
        }

    @property
    def defers(self) -> bool:
        return self.deferral and self.schedule in ("zb1p", "dualpipe", "dualpipev")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def timeout_factor(self) -> float:
        """How much longer than on a core each the ranks may wait for one another."""
        return max(1.0, self.world_size / CORES)


def _init_parallel(
    pp: int = 1,
    vp: int | None = None,
    ep: int = 1,
    tp: int = 1,
    schedule: str | None = None,
    timeout_factor: float = 1.0,
) -> None:
    ranks = embedding_ranks(None if schedule is None else schedule_spec(schedule))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=ep,
        distributed_timeout_minutes=TIMEOUT_MIN * timeout_factor,
        **({"get_embedding_ranks": ranks} if ranks else {}),
    )
    megatron_random.model_parallel_cuda_manual_seed(INIT_SEED)


def _data(dp_rank: int, microbatches: int = NUM_MICROBATCHES) -> list[dict[str, torch.Tensor]]:
    return tm.synthetic_microbatches(
        microbatches, micro_batch_size=MICRO_BATCH_SIZE, seed=DATA_SEED + dp_rank
    )


def _take_mtp_losses() -> list[float]:
    """The MTP losses Megatron's tracker summed over this process's micro-batches since the
    last call ([] without MTP layers here), and a clean tracker."""
    values = MTPLossLoggingHelper.tracker.get(mtp_tracker_fields()[0])
    if values is None:
        return []
    taken = values.tolist()
    clean_mtp_tracker()
    return taken


def _merge(per_chunk: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One rank's chunks' tensors by global name; a name in two chunks is one parameter held
    twice (the embedding and its copy for tied embeddings or MTP), whose values must agree
    (NaN: not known here, see :func:`_gradients`)."""
    merged: dict[str, torch.Tensor] = {}
    for part in per_chunk:
        for name, value in part.items():
            if name in merged:
                both = ~(merged[name].isnan() | value.isnan())
                assert torch.equal(merged[name][both], value[both]), f"the copies of {name} differ"
                value = torch.where(value.isnan(), merged[name], value)
            merged[name] = value
    return merged


def _gradients(chunk: torch.nn.Module, layout: Layout) -> dict[str, torch.Tensor]:
    """A chunk's gradients by global name; with the distributed optimizer only the part of
    each ``main_grad`` in this rank's shard of its DDP bucket, the only part reduced over
    the data-parallel ranks (NaN elsewhere)."""
    grads = tm.global_gradients(chunk)
    if not layout.distributed_optimizer:
        return grads
    names = {id(p): n for n, p in global_named_parameters(chunk).items()}
    for buffer in chunk.buffers + chunk.expert_parallel_buffers:
        dp, rank = buffer.data_parallel_world_size, buffer.data_parallel_group.rank()
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            bucket = buffer.buckets[bucket_id]
            shard = bucket.grad_data.numel() // dp
            lo, hi = bucket.offset + rank * shard, bucket.offset + (rank + 1) * shard
            owned = torch.zeros(end - start, dtype=torch.bool)
            owned[max(lo, start) - start : max(min(hi, end), start) - start] = True
            grad = grads[names[id(param)]].reshape(-1)
            grad[~owned] = float("nan")
    return grads


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


def _assert_close_by_name(
    what: str, actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> float:
    errors = {name: _rel_err(actual[name], expected[name]) for name in actual}
    bad = {n: e for n, e in errors.items() if not e <= REL_TOL}
    assert not bad, f"{what}: relative error above {REL_TOL}: " + ", ".join(
        f"{n}={e:.2e}" for n, e in sorted(bad.items(), key=lambda kv: -kv[1])[:8]
    )
    return max(errors.values(), default=0.0)


# --------------------------------------------------------------------------------------
# Workers (run in forked processes).


def _reference_worker(
    rank: int, world_size: int, model: Model, dp: int, microbatches: int
) -> dict[str, Any]:
    """One rank, no pipeline: the weights every run starts from, plus the losses and
    gradients of a plain loop, of Megatron's no-pipelining schedule, and of one clipped
    SGD step."""
    _init_parallel()
    try:
        config = model.config()
        torch.manual_seed(INIT_SEED)
        reference = tm.build_reference_gpt(config, **model.build_kwargs())
        state = tm.global_state(reference)
        batches = [batch for d in range(dp) for batch in _data(d, microbatches)]
        losses = tm.run_reference_step(reference, batches)
        mtp_losses = [v / len(batches) for v in _take_mtp_losses()]
        grads = tm.global_gradients(reference)

        params = tm.global_named_parameters(reference)
        grad_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP_GRAD).item()
        torch.optim.SGD(params.values(), lr=LR, momentum=MOMENTUM).step()
        stepped = tm.global_state(reference)

        twin = tm.build_reference_gpt(config, **model.build_kwargs())
        tm.load_global_state(twin, state)
        loss_dicts = megatron_schedules.forward_backward_no_pipelining(
            forward_step_func=tm.gpt_forward_step,
            data_iterator=iter(batches),
            model=[twin],
            num_microbatches=len(batches),
            seq_length=tm.SEQ_LENGTH,
            micro_batch_size=MICRO_BATCH_SIZE,
        )
        return {
            "state": state,
            "losses": losses,
            "mtp_losses": mtp_losses,
            "grads": grads,
            "grad_norm": grad_norm,
            "stepped": stepped,
            "no_pipelining_losses": [d["loss"].item() for d in loss_dicts],
            "no_pipelining_grads": tm.global_gradients(twin),
        }
    finally:
        parallel_state.destroy_model_parallel()


def _build_chunks(model: Model, layout: Layout) -> list[torch.nn.Module]:
    """This rank's chunks: Megatron's placement, or our schedule's (V, mirror)."""
    parallel: dict[str, Any] = dict(
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp,
        expert_model_parallel_size=layout.ep,
        tensor_model_parallel_size=layout.tp,
        batch_p2p_comm=layout.batch_p2p_comm,
        **dict(layout.recompute),
    )
    if model.moe:
        parallel["moe_token_dispatcher_type"] = layout.dispatcher
    if layout.schedule not in ("dualpipe", "dualpipev"):
        config = model.config(**parallel, **layout.split())
        return list(tm.build_tiny_gpt_chunks(config, **model.build_kwargs()))
    setup = pipeline_setup(
        layout.schedule,
        layout.pp,
        model.num_layers,
        first=layout.first,
        last=layout.last,
        layout=layout.layout,
        mtp_num_layers=model.mtp,
    )
    placement = StagePlacementLayout(setup, model.mtp)
    config = model.config(**parallel, pipeline_model_parallel_layout=placement)
    roles = placement.roles(parallel_state.get_pipeline_model_parallel_rank())
    return [
        tm.build_tiny_gpt(
            config,
            pre_process=role.pre_process,
            post_process=role.post_process,
            vp_stage=role.chunk,
            **model.build_kwargs(),
        )
        for role in roles
    ]


def _ready_chunks(
    model: Model, layout: Layout, state: dict[str, torch.Tensor], *, ddp: bool
) -> list[torch.nn.Module]:
    """This rank's chunks with the reference weights, dW deferral (our schedules), DDP and
    its config hooks, and dualpipe's mirror copies made equal."""
    chunks = _build_chunks(model, layout)
    config = chunks[0].config
    for chunk in chunks:
        tm.load_global_state(chunk, state)
    mark_tied_copies(chunks)
    mark_position_copies(chunks)
    if layout.defers:
        assert enable_weight_grad_deferral(chunks) > 0
    if ddp:
        mirror = layout.schedule == "dualpipe" and not layout.megatron_lm_bucketing
        chunks = [
            DistributedDataParallel(
                config, _ddp_config(layout), c, disable_bucketing=i > 0 or mirror
            )
            for i, c in enumerate(chunks)
        ]
        config.finalize_model_grads_func = finalize_model_grads
        if layout.overlap_grad_reduce:
            config.no_sync_func = [c.no_sync for c in chunks]
    if layout.schedule == "dualpipe":
        prepare_mirrors(chunks, slice_bytes=MIRROR_SLICE_BYTES)
    return chunks


def _explicit_groups(config: Any) -> dict[str, Any]:
    """Megatron's explicit process-group arguments, built as its schedules build them."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups()
    return {
        "p2p_communicator": P2PCommunicator(pp_group=groups.pp, config=config),
        "pg_collection": groups,
    }


def _step(schedule: Any, chunks: list[torch.nn.Module], batches: list, layout: Layout) -> list:
    """One forward-backward call; Megatron's own schedules take one iterator per chunk."""
    groups = _explicit_groups(chunks[0].config) if layout.explicit_groups else {}
    return schedule(
        **groups,
        forward_step_func=tm.gpt_forward_step,
        data_iterator=[iter(batches) for _ in chunks] if layout.schedule is None else iter(batches),
        model=chunks,
        num_microbatches=layout.microbatches,
        seq_length=tm.SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
    )


def _count_deferred_work() -> list[int]:
    """Count, in this worker process, the dW work layers hand to a weight-gradient store."""
    count = [0]
    defer = WeightGradStore.defer

    def counting(store: WeightGradStore, work: Any) -> None:
        count[0] += 1
        defer(store, work)

    WeightGradStore.defer = counting
    return count


def _ddp_config(layout: Layout) -> DistributedDataParallelConfig:
    options = dict(
        overlap_grad_reduce=layout.overlap_grad_reduce,
        use_distributed_optimizer=layout.distributed_optimizer,
        bucket_size=layout.bucket_size,
    )
    if layout.defers:
        return ddp_config_for_deferral(**options)
    return DistributedDataParallelConfig(**options)


def _loss_microbatches(layout: Layout) -> list[int]:
    """The micro-batches whose loss this rank computes, in the order it computes them."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if layout.schedule in (None, "1f1b", "interleaved-1f1b"):
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        return list(range(layout.microbatches)) if last else []
    schedule = generate(layout.schedule, layout.pp, layout.microbatches)
    p = schedule.placement
    return [
        half.microbatch
        for action in schedule.ranks[pp_rank]
        for half in action.computes
        if half.kind is Kind.F and p.next_stage(half.stage) is None
    ]


def _peak_activation_bytes(schedule: Any, chunks: list[torch.nn.Module]) -> int | None:
    """The runtime's measured peak of saved activation bytes in the step (our schedules)."""
    executor = getattr(schedule, "executor", None)
    return None if executor is None else executor(chunks).peak_activation_bytes


def _pipelined_worker(
    rank: int, world_size: int, model: Model, layout: Layout, state: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """One training step with the schedule of ``layout`` on this rank."""
    _init_parallel(
        layout.pp, layout.vp, layout.ep, layout.tp, layout.schedule, layout.timeout_factor
    )
    try:
        chunks = _ready_chunks(model, layout, state, ddp=layout.ddp)
        optimizer = None
        if layout.optimizer:
            optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="sgd",
                    lr=LR,
                    sgd_momentum=MOMENTUM,
                    weight_decay=0.0,
                    clip_grad=CLIP_GRAD,
                    use_distributed_optimizer=layout.distributed_optimizer,
                ),
                chunks,
            )

        batches = _data(parallel_state.get_data_parallel_rank(), layout.microbatches)
        schedule = get_forward_backward_func(
            pipeline_schedule=layout.schedule, mirror_slice_bytes=MIRROR_SLICE_BYTES
        )
        deferred = _count_deferred_work()
        loss_dicts = _step(schedule, chunks, batches, layout)
        result: dict[str, Any] = {
            "schedule": getattr(schedule, "__name__", None) or schedule.schedule_name,
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "loss_microbatches": _loss_microbatches(layout),
            "losses": [d["loss"].item() for d in loss_dicts],
            "mtp_losses": _take_mtp_losses(),
            "grads": _merge([_gradients(c, layout) for c in chunks]),
            "deferred": deferred[0],
            "peak_bytes": _peak_activation_bytes(schedule, chunks),
        }
        if optimizer is not None:
            success, grad_norm, _ = optimizer.step()
            assert success, "optimizer step skipped"
            result["grad_norm"] = grad_norm
            result["stepped"] = _merge([tm.global_state(c) for c in chunks])
        return result
    finally:
        parallel_state.destroy_model_parallel()


# --------------------------------------------------------------------------------------
# Running and checking.


def _reference(model: Model, dp: int, microbatches: int = NUM_MICROBATCHES) -> dict[str, Any]:
    """The single-process run of ``model`` (one per model, DP and micro-batch count)."""
    return _reference_run(model, dp, microbatches)


@functools.cache
def _reference_run(model: Model, dp: int, microbatches: int) -> dict[str, Any]:
    (result,) = run_workers(
        _reference_worker,
        1,
        args=(model, dp, microbatches),
        timeout_s=RUN_TIMEOUT_S,
        pg_timeout_s=PG_TIMEOUT_S,
    )
    return result


def _run(model: Model, layout: Layout) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    reference = _reference(model, layout.dp, layout.microbatches)
    results = run_workers(
        _pipelined_worker,
        layout.world_size,
        args=(model, layout, reference["state"]),
        timeout_s=RUN_TIMEOUT_S * layout.timeout_factor,
        pg_timeout_s=PG_TIMEOUT_S * layout.timeout_factor,
    )
    return reference, results


def _check(model: Model, layout: Layout, expected_schedule: str) -> dict[str, Any]:
    """Run ``layout`` and assert it matches the reference; returns the max errors."""
    reference, results = _run(model, layout)
    assert {r["schedule"] for r in results} == {expected_schedule}

    worst = {"loss": 0.0, "grad": 0.0}
    known = {name: torch.zeros_like(g, dtype=torch.bool) for name, g in reference["grads"].items()}
    for rank, result in enumerate(results):
        # With deferral, every rank's B actions leave their dW to the W actions.
        assert (result["deferred"] > 0) == layout.defers, (rank, result["deferred"])
        grads = result["grads"]
        for name, grad in grads.items():
            known[name] |= ~grad.isnan()
        expected = {  # where a rank knows only part of a gradient (its shard), that part
            n: torch.where(grads[n].isnan(), grads[n], reference["grads"][n]) for n in grads
        }
        actual = {n: g.nan_to_num() for n, g in grads.items()}
        worst["grad"] = max(
            worst["grad"],
            _assert_close_by_name(
                f"rank {rank} gradients", actual, {n: e.nan_to_num() for n, e in expected.items()}
            ),
        )
        m = layout.microbatches
        expected = reference["losses"][result["dp_rank"] * m : (result["dp_rank"] + 1) * m]
        assert len(result["losses"]) == len(result["loss_microbatches"])
        for mb, loss in zip(result["loss_microbatches"], result["losses"], strict=True):
            error = abs(loss - expected[mb]) / abs(expected[mb])
            assert error <= REL_TOL, f"rank {rank} micro-batch {mb}: {loss} != {expected[mb]}"
            worst["loss"] = max(worst["loss"], error)
    unknown = sorted(n for n, k in known.items() if not k.all())
    assert not unknown, f"no rank holds every element of the reduced gradients of {unknown}"
    for d in range(layout.dp):
        computed = sorted(mb for r in results if r["dp_rank"] == d for mb in r["loss_microbatches"])
        # TP ranks each compute every loss of their stage.
        assert computed == sorted(list(range(layout.microbatches)) * layout.tp)
    if model.mtp:
        # Each MTP rank's tracker holds the sum over its micro-batches (under dualpipe two
        # ranks hold half each): the mean over every micro-batch is the reference's.
        holders = [r["mtp_losses"] for r in results if r["mtp_losses"]]
        summed = [sum(v) for v in zip(*holders, strict=True)]
        mean = [v / (layout.microbatches * layout.dp) for v in summed]
        worst["mtp_loss"] = max(
            abs(a - b) / abs(b) for a, b in zip(mean, reference["mtp_losses"], strict=True)
        )
        assert worst["mtp_loss"] <= REL_TOL, (mean, reference["mtp_losses"])
    covered = set().union(*(r["grads"] for r in results))
    assert covered == set(reference["grads"]), (
        f"gradients missing: {sorted(set(reference['grads']) - covered)}, "
        f"unexpected: {sorted(covered - set(reference['grads']))}"
    )
    if layout.optimizer:
        worst["grad_norm"] = max(
            abs(r["grad_norm"] - reference["grad_norm"]) / reference["grad_norm"] for r in results
        )
        assert worst["grad_norm"] <= REL_TOL
        assert reference["grad_norm"] > CLIP_GRAD, "clipping not exercised"
        for rank, result in enumerate(results):
            worst["stepped"] = max(
                worst.get("stepped", 0.0),
                _assert_close_by_name(
                    f"rank {rank} weights after the SGD step",
                    result["stepped"],
                    reference["stepped"],
                ),
            )
    print(f"\n{layout}: max relative errors {worst}")
    worst["deferred"] = [r["deferred"] for r in results]
    worst["peak_bytes"] = [r["peak_bytes"] for r in results]
    return worst


def _trajectory_worker(
    rank: int,
    world_size: int,
    model: Model,
    layout: Layout,
    state: dict[str, torch.Tensor],
    steps: int,
) -> dict[str, Any]:
    """``steps`` training iterations on one batch with Megatron's DDP and Adam; returns the
    micro-batches whose losses this rank computes and, per iteration, those losses and the
    MTP losses of its tracker, and the gradients of the first iteration by global name."""
    _init_parallel(
        layout.pp, layout.vp, layout.ep, layout.tp, layout.schedule, layout.timeout_factor
    )
    try:
        chunks = _ready_chunks(model, layout, state, ddp=True)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=1e-3,
                weight_decay=0.01,
                clip_grad=1.0,
                use_distributed_optimizer=layout.distributed_optimizer,
            ),
            chunks,
        )
        schedule = get_forward_backward_func(
            pipeline_schedule=layout.schedule, mirror_slice_bytes=MIRROR_SLICE_BYTES
        )
        trajectory, mtp, grads = [], [], {}
        batches = _data(0, layout.microbatches)  # the same batch each time: the loss falls
        for step in range(steps):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            loss_dicts = _step(schedule, chunks, batches, layout)
            if step == 0:
                grads = _merge([tm.global_gradients(c) for c in chunks])
            success, _, _ = optimizer.step()
            assert success, "optimizer step skipped"
            trajectory.append([d["loss"].item() for d in loss_dicts])
            mtp.append(_take_mtp_losses())
        return {
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "mbs": _loss_microbatches(layout),
            "losses": trajectory,
            "mtp_losses": mtp,
            "grads": grads,
        }
    finally:
        parallel_state.destroy_model_parallel()


@dataclass(frozen=True)
class Training:
    """``steps`` Adam iterations on one batch: per iteration the mean loss and the mean MTP
    loss of each MTP layer (over the batch's micro-batches), and the first iteration's
    gradients by global name (every rank's, merged)."""

    losses: list[float]
    mtp_losses: list[list[float]]
    grads: dict[str, torch.Tensor]


def _training(
    model: Model, layout: Layout, steps: int = 5, timeout_factor: float | None = None
) -> Training:
    """``layout``'s run; its ranks wait ``timeout_factor`` (default the layout's own) times
    the time bounds of ranks on a core each."""
    reference = _reference(model, layout.dp, layout.microbatches)
    factor = layout.timeout_factor if timeout_factor is None else timeout_factor
    results = run_workers(
        _trajectory_worker,
        layout.world_size,
        args=(model, layout, reference["state"], steps),
        timeout_s=RUN_TIMEOUT_S * factor,
        pg_timeout_s=PG_TIMEOUT_S * factor,
    )
    means, mtp_means = [], []
    for step in range(steps):
        by_mb = {
            mb: loss for r in results for mb, loss in zip(r["mbs"], r["losses"][step], strict=True)
        }
        assert sorted(by_mb) == list(range(layout.microbatches))
        means.append(sum(by_mb.values()) / len(by_mb))
        # Every data-parallel rank ran the same batch: one pipeline's trackers hold its sum.
        first = [r for r in results if r["dp_rank"] == 0]
        trackers = [r["mtp_losses"][step] for r in first if r["mtp_losses"][step]]
        mtp_means.append([sum(v) / layout.microbatches for v in zip(*trackers, strict=True)])
    grads: dict[str, torch.Tensor] = {}
    if not layout.distributed_optimizer:  # else each rank's main_grad is right on its shard
        for result in results:
            grads = _merge([grads, result["grads"]])
    return Training(means, mtp_means, grads)


@functools.cache
def _reference_training(
    model: Model, microbatches: int, steps: int, timeout_factor: float
) -> Training:
    """The one-process run: all of the pipelined run's work on one rank, so it is given the
    pipelined run's time bound (a loaded machine took over 60 s for eight micro-batches)."""
    return _training(model, Layout(pp=1, microbatches=microbatches), steps, timeout_factor)


def _trajectory(model: Model, layout: Layout, steps: int = 5) -> list[float]:
    """The mean loss of each of ``steps`` iterations (one data-parallel rank)."""
    return _training(model, layout, steps).losses


def check_training(model: Model, layout: Layout, steps: int = 5) -> dict[str, float]:
    """``layout`` against the one-process unpipelined run (Megatron's no-pipelining schedule,
    same DDP and Adam) over ``steps`` iterations: every iteration's loss within 1e-6 relative
    (tests/digits.py: clipped, another placement), the first iteration's gradients within
    1e-5 per parameter by global name; returns the max relative errors.

    The MTP loss is what Megatron reports: its tracker's fp32 sum over the micro-batches, in
    the order the schedule computes them, over their number. Summed in another order it
    may differ by the sum's rounding (up to one fp32 epsilon per micro-batch, relative),
    which can reach the 7th digit: it must agree to within that."""
    reference = _reference_training(model, layout.microbatches, steps, layout.timeout_factor)
    ours = _training(model, layout, steps)
    assert set(ours.grads) == set(reference.grads), (
        f"gradients missing: {sorted(set(reference.grads) - set(ours.grads))}, "
        f"unexpected: {sorted(set(ours.grads) - set(reference.grads))}"
    )
    worst = {"grad": _assert_close_by_name("gradients", ours.grads, reference.grads)}
    different = beyond(ours.losses, reference.losses)
    assert not different, f"losses differ from the reference: {different}"
    worst["loss"] = max(
        abs(a - b) / abs(b) for a, b in zip(ours.losses, reference.losses, strict=True)
    )
    mtp = [
        (a, b)
        for step, ref in zip(ours.mtp_losses, reference.mtp_losses, strict=True)
        for a, b in zip(step, ref, strict=True)
    ]
    rounding = layout.microbatches * FP32_EPS
    off = [(f"{a:.7E}", f"{b:.7E}") for a, b in mtp if abs(a - b) > rounding * abs(b)]
    assert not off, f"MTP losses differ from the reference beyond the fp32 sum's rounding: {off}"
    worst["mtp_loss"] = max((abs(a - b) / abs(b) for a, b in mtp), default=0.0)
    assert bool(mtp) == bool(model.mtp)
    assert ours.losses[-1] < ours.losses[0], f"{steps} Adam steps should lower the loss"
    print(f"\n{layout}: {steps} Adam steps, max relative errors {worst}")
    return worst
