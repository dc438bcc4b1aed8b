"""F&B overlap (``overlap_moe_expert_parallel_comm``) under dualpipe and dualpipev: each FB
pair runs one micro-batch's forward interleaved with another's backward through
Megatron-Core's schedule plan.

What must hold (bf16 on CPU+gloo, tiny MoE with 4 experts top-2, EP=2): overlap on and off
give bit-identical losses and gradients (main_grad by global parameter name) under the
same schedule and precision, with dW deferral on or off and with overlap_grad_reduce; every
FB action runs overlapped; every linear layer's dW is computed exactly once per
micro-batch; the nodes of one FB pair run in the order Megatron's plan interleaves them.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel.utils import ScheduleNode

from megatron_dualpipe.megatron.compat.version import layer_plan_attention_node
from megatron_dualpipe.megatron.grads.deferral import (
    DeferrableColumnParallelLinear,
    DeferrableRowParallelLinear,
    ddp_config_for_deferral,
    enable_weight_grad_deferral,
)
from megatron_dualpipe.megatron.grads.mirror import prepare_mirrors
from megatron_dualpipe.megatron.model.placement import StagePlacementLayout, chunk_roles
from megatron_dualpipe.megatron.model.precision import StageFloat16Module
from megatron_dualpipe.megatron.schedule.checks import pipeline_setup
from megatron_dualpipe.megatron.schedule.registry import get_forward_backward_func
from megatron_dualpipe.megatron.schedule.stage import MegatronStage
from megatron_dualpipe.schedules.pipeline_setup import PipelineSetup
from tests import tiny_models as tm
from tests.megatron_harness import PG_TIMEOUT_S, _init_parallel
from tests.multiproc import run_workers, slow_unless

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.multiproc,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU+gloo: the GPU check covers CUDA"),
]

NUM_LAYERS = 8
EP = 2
MICRO_BATCH_SIZE = 2


@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    deferral: bool = True
    overlap_grad_reduce: bool = False

    @property
    def world_size(self) -> int:
        return self.pp * EP  # data parallel = EP

    @property
    def microbatches(self) -> int:
        return 2 * self.pp + (2 if self.schedule == "dualpipe" else 0)


def _setup(case: Case) -> PipelineSetup:
    return pipeline_setup(case.schedule, case.pp, NUM_LAYERS)


def _config(case: Case) -> Any:
    return tm.tiny_gpt_config(
        num_layers=NUM_LAYERS,
        num_moe_experts=4,
        expert_model_parallel_size=EP,
        pipeline_model_parallel_size=case.pp,
        pipeline_model_parallel_layout=StagePlacementLayout(_setup(case)),
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        overlap_moe_expert_parallel_comm=True,  # validated with it on; each run sets its own
    )


def _model(case: Case, config: Any, state: dict | None) -> tuple[list, Counter, dict]:
    """This rank's chunks (initial weights from ``state`` when given), deferral (if asked),
    Float16Module with our ends, DDP; plus a counter of dW accumulations per layer."""
    rank = parallel_state.get_pipeline_model_parallel_rank()
    roles = chunk_roles(_setup(case), rank)
    torch.manual_seed(1234)
    chunks = [
        tm.build_tiny_gpt(
            config, pre_process=r.pre_process, post_process=r.post_process, vp_stage=r.chunk
        )
        for r in roles
    ]
    if state is None:
        state = {k: v for c in chunks for k, v in tm.global_state(c).items()}
    for chunk in chunks:
        tm.load_global_state(chunk, state)
    dw_counts: Counter = Counter()
    if case.deferral:
        enable_weight_grad_deferral(chunks)
        for c, chunk in enumerate(chunks):
            for name, layer in chunk.named_modules():
                if isinstance(layer, DeferrableColumnParallelLinear | DeferrableRowParallelLinear):
                    key = f"{roles[c].stage}:{name}"
                    layer.register_wgrad_accumulation_and_reduce_hooks(
                        functools.partial(dw_counts.update, [key])
                    )
    chunks = [
        StageFloat16Module(config, c, pre_process=r.pre_process, post_process=r.post_process)
        for c, r in zip(chunks, roles, strict=True)
    ]
    options = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=case.overlap_grad_reduce)
    ddp_config = (
        ddp_config_for_deferral(**options)
        if case.deferral
        else DistributedDataParallelConfig(**options)
    )
    model = [
        DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    if case.overlap_grad_reduce:
        config.no_sync_func = [m.no_sync for m in model]
    if case.schedule == "dualpipe":
        prepare_mirrors(model)
    return model, dw_counts, state


_FB_ORDER: list[list[str]] = []


def _recording_fb_order(monkeypatch_targets: list) -> None:
    """Record the schedule-plan nodes (direction and name) that run inside the first FB
    pair of the step (test instrumentation of this forked worker only)."""
    original_fb = MegatronStage.forward_backward_planned
    original_forward, original_backward = ScheduleNode._forward, ScheduleNode._backward
    current: list[list[str]] = []

    def forward_backward_planned(self, *args, **kwargs):
        current.append([])
        try:
            return original_fb(self, *args, **kwargs)
        finally:
            _FB_ORDER.append(current.pop())

    def node_forward(self, *inputs):
        if current:
            current[-1].append(f"F {self.name}")
        return original_forward(self, *inputs)

    def node_backward(self, *grads):
        if current:
            current[-1].append(f"B {self.name}")
        return original_backward(self, *grads)

    MegatronStage.forward_backward_planned = forward_backward_planned
    ScheduleNode._forward, ScheduleNode._backward = node_forward, node_backward
    monkeypatch_targets += [
        (MegatronStage, "forward_backward_planned", original_fb),
        (ScheduleNode, "_forward", original_forward),
        (ScheduleNode, "_backward", original_backward),
    ]


def _worker(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    """One training step with overlap off, then the same with overlap on, same weights."""
    _init_parallel(case.pp, None, EP)
    restore: list = []
    try:
        batches = tm.synthetic_microbatches(
            case.microbatches,
            micro_batch_size=MICRO_BATCH_SIZE,
            seed=7 + parallel_state.get_data_parallel_rank(),
        )
        runs: dict[bool, dict[str, Any]] = {}
        state = None
        for overlap in (False, True):
            config = _config(case)
            config.overlap_moe_expert_parallel_comm = overlap
            model, dw_counts, state = _model(case, config, state)
            if overlap:
                _recording_fb_order(restore)
            forward_backward = get_forward_backward_func(pipeline_schedule=case.schedule)
            for chunk in model:
                chunk.zero_grad_buffer()
            loss_dicts = forward_backward(
                forward_step_func=tm.gpt_forward_step,
                data_iterator=iter(batches),
                model=model,
                num_microbatches=case.microbatches,
                seq_length=tm.SEQ_LENGTH,
                micro_batch_size=MICRO_BATCH_SIZE,
            )
            grads = {
                name: param.main_grad.clone()
                for chunk in model
                for name, param in tm.global_named_parameters(chunk).items()
            }
            runs[overlap] = {
                "losses": [d["loss"].item() for d in loss_dicts],
                "grads": grads,
                "overlap": forward_backward.last_overlap,
                "dw": dict(dw_counts),
            }
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        return {**runs[True], "off": runs[False], "fb_order": _FB_ORDER[:1], "pp_rank": pp_rank}
    finally:
        for owner, name, value in restore:
            setattr(owner, name, value)
        parallel_state.destroy_model_parallel()


@functools.cache
def _run(case: Case) -> list[dict[str, Any]]:
    return run_workers(
        _worker, case.world_size, args=(case,), timeout_s=240, pg_timeout_s=PG_TIMEOUT_S
    )


CASES = [
    Case("dualpipev", 2),
    Case("dualpipe", 2),
    Case("dualpipev", 4),
    Case("dualpipe", 4),
    Case("dualpipev", 2, deferral=False),
    Case("dualpipe", 2, deferral=False),
    Case("dualpipev", 2, overlap_grad_reduce=True),
    Case("dualpipe", 2, overlap_grad_reduce=True),
]


def _fast_first(cases: list[Case]) -> list:
    """Cases as parameters, all but dualpipev at PP2 with deferral marked slow (the fast
    loop runs that one)."""
    return slow_unless(lambda c: c == Case("dualpipev", 2), cases, ids=_id)


def _id(case: Case) -> str:
    flags = ["defer" if case.deferral else "no-defer"] + ["ogr"] * case.overlap_grad_reduce
    return f"{case.schedule}-pp{case.pp}-{'-'.join(flags)}"


@pytest.mark.parametrize("case", _fast_first(CASES))
def test_overlap_gives_bit_identical_losses_and_gradients(case: Case) -> None:
    for rank, result in enumerate(_run(case)):
        off = result["off"]
        assert result["losses"] == off["losses"], f"rank {rank}"
        assert result["grads"].keys() == off["grads"].keys()
        different = [n for n, g in result["grads"].items() if not torch.equal(g, off["grads"][n])]
        assert not different, f"rank {rank}: gradients differ for {different[:5]}"
        assert any(g.abs().max() > 0 for g in result["grads"].values())


@pytest.mark.parametrize("case", _fast_first(CASES))
def test_every_fb_action_runs_overlapped(case: Case) -> None:
    for result in _run(case):
        on, off = result["overlap"], result["off"]["overlap"]
        assert on.overlapped == on.fb_actions > 0
        assert off.overlapped == 0 and off.fb_actions == on.fb_actions


@pytest.mark.parametrize("case", _fast_first([c for c in CASES if c.deferral]))
def test_each_layer_computes_its_weight_gradient_once_per_microbatch(case: Case) -> None:
    for result in _run(case):
        assert result["dw"] == result["off"]["dw"]
        attention = {k: n for k, n in result["dw"].items() if ".self_attention." in k}
        assert attention, "no attention layer was counted"
        # Each chunk processes every micro-batch (dualpipe: its direction's half).
        share = case.microbatches // (2 if case.schedule == "dualpipe" else 1)
        assert set(attention.values()) == {share}


def _plan_order(f_layers: int, b_layers: int, f_loss: bool, b_loss: bool) -> list[str]:
    """The node order of Megatron's TransformerModelChunkSchedulePlan.run for a forward of
    ``f_layers`` MoE layers beside a backward of ``b_layers`` (TransformerLayerSchedulePlan.run
    per overlapped layer: combine-bwd | attn-fwd | mlp-bwd | dispatch-fwd | dispatch-bwd |
    mlp-fwd | combine-fwd | attn-bwd); then the forward's loss function where it has one."""
    attn = layer_plan_attention_node()  # "attn", from 0.19 "pre_dispatch_computation"
    order = ["F pre_process"] + ["B post_process"] * b_loss
    pair = ["B moe_combine", f"F {attn}", "B mlp", "F moe_dispatch", "B moe_dispatch", "F mlp"]
    pair += ["F moe_combine", f"B {attn}"]
    order += pair * min(f_layers, b_layers)
    order += ["B moe_combine", "B mlp", "B moe_dispatch", f"B {attn}"] * max(b_layers - f_layers, 0)
    order += [f"F {attn}", "F moe_dispatch", "F mlp", "F moe_combine"] * max(f_layers - b_layers, 0)
    order += ["F post_process"] * f_loss + ["B pre_process"]
    return order + ["F loss_func"] * f_loss  # the loss function's node, after the plan


@pytest.mark.parametrize("case", _fast_first([Case("dualpipev", 2), Case("dualpipe", 2)]))
def test_one_fb_pair_interleaves_forward_and_backward_nodes(case: Case) -> None:
    layers = NUM_LAYERS // (2 * case.pp if case.schedule == "dualpipev" else case.pp)
    for rank, result in enumerate(_run(case)):
        (order,) = result["fb_order"]
        roles = chunk_roles(_setup(case), result["pp_rank"])
        # The first FB pair of every rank forwards one chunk and backwards the other.
        candidates = [
            _plan_order(layers, layers, f.post_process, b.post_process)
            for f, b in ((roles[0], roles[1]), (roles[1], roles[0]))
        ]
        assert order in candidates, f"rank {rank}: {order}"
