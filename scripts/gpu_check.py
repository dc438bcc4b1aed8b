#!/usr/bin/env python
"""GPU checks of what users run on GPUs (not part of CI): Transformer Engine layers under our
dW deferral, the F&B overlap path's contexts with FP8, and the per-layer costs that
``megatron-dualpipe simulate --cost`` and the schedule optimiser take. On one GPU:

    python scripts/gpu_check.py              # every check (a few minutes on an H100/H200)
    python scripts/gpu_check.py --dry-run    # the checks, and why any cannot run here
    python scripts/gpu_check.py --only layer-costs-moe

Each check prints one line, ``CHECK <name>: PASS: ...``, ``CHECK <name>: FAIL: ...`` or
``CHECK <name>: CANNOT RUN: <reason>``; the exit code is 1 when one failed, else 0 (a check
that cannot run is not a failure). Needs CUDA, megatron-core and Transformer Engine >= 2.7;
the FP8 checks need compute capability 9.0 (Hopper) or newer.

- ``te-deferral-bf16``, ``te-deferral-fp8``: a GPT of Megatron's TE spec (a dense model with
  biases and a MoE model with grouped-GEMM experts) built twice from the same weights,
  Megatron DDP with ``overlap_grad_reduce`` off and on: plain backwards, and our deferral
  (``megatron_dualpipe.megatron.model.chunks``: ``delay_wgrad_compute``, hooked TE layers, DDP
  for deferral) in DualPipe's order, B0 and B1 (dX only; no deferred ``main_grad`` may
  move), a full backward BW2 between, then W0 and W1; two steps. Every ``main_grad`` must
  equal the reference's (max |a - b| / max |b| <= --tol; FP8 with Megatron's tensorwise
  recipe, whose scaling is the same in both orders).
- ``overlap-contexts-fp8``: a bf16 MoE GPT with FP8's delayed recipe runs a forward through
  Megatron's schedule plan as our F&B overlap path runs it (``schedule_plan.run_plans``) and
  as the plan runs bare: FP8 is really on only when every TE layer's forward amax history
  moved under ours, and it is off in the bare run (what Megatron's own per-layer contexts
  leave to the outer FP8 context of the delayed recipe).
- ``layer-costs-dense``, ``layer-costs-moe``: one transformer layer at hidden 4096 and
  sequence 4096 (GQA 32/8 heads, SwiGLU 14336; MoE: 8 experts top-2, grouped GEMM, EP=1),
  bf16, deferral on: median F, B (dX) and W (dW) times of --repeats, and the bytes the layer
  saves from F to B and holds from B to W beside what ``planner/memory.py`` predicts;
  printed as ``simulate --cost F=..,B=..,W=..`` (ms per layer). It fails when W takes no
  time (dW not deferred).

- ``graphs-te-order``: TE's ``make_graphed_callables`` fed ``cuda_graph_order`` of
  dualpipev at PP=4, 8 micro-batches, rank 0 (two one-layer chunks of ``te.Linear`` with
  ``delay_wgrad_compute``, the other ranks' messages stood in by fixed tensors) and replayed
  in that order: weight gradients equal to the eager run of the same order, ms per step
  both ways; and rank 1's order at PP=8, which ``check_cuda_graph_order`` refuses (two
  wgrads of one chunk waiting), refused or miscaptured by TE too (else the model is wrong).
- ``graphs-te-buffers``: dualpipev at PP=4, rank 3 (whose last Ws wait behind other
  backwards), each chunk a TE-graphed ``te.Linear`` followed by an eager ``te.Linear``
  deferring its wgrad to the W: the deferred W reads the graph's output after other graphs
  replayed. Captured as our helper asks TE (buffers kept) the weight gradients equal the
  eager run's; as Megatron asks (``_reuse_graph_input_output_buffers``, buffers handed
  back to the pool) the difference is measured and printed beside it (what
  ``tests/te_graph_stand_in.py`` models on CPU).
- ``graphs-full-step``: ``PipelineExecutor(graph_safe=True)`` on one rank holding both
  chunks of a two-stage pipeline with deferred W, captured whole with ``torch.cuda.graph``
  (what ``FullCudaGraphWrapper`` does with a step) and replayed: losses and gradients equal
  to the eager step's, ms per step both ways. Messages between ranks are not in it (one GPU).

Not here, because they need two GPUs (NCCL refuses two ranks of one communicator on one
GPU): dualpipev's first steps after Megatron's ``initialize_model_parallel`` and dualpipe's
mirror sum of two stages of different bucket counts are ``scripts/nccl_check.py``'s
``dualpipev-pp2`` and ``mirror`` (its world made as Megatron-LM makes it).

Not measured: the F&B overlap factor (how much of the MoE all-to-all hides behind the other
micro-batch's compute, ``simulate --cost overlap=``): it needs expert parallelism over two or
more GPUs, and an EP=1 pair on one GPU has no all-to-all to hide.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

# The checkout's root: the package, and the tests' tiny models (tests/tiny_models.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TE_MIN = "2.7.0"
SEED = 1234
MICRO_BATCH_SIZE = 2


@dataclass(frozen=True)
class Check:
    name: str
    summary: str
    fp8: bool
    run: Callable[[argparse.Namespace], tuple[bool, str]]


def _say(name: str, verdict: str, detail: str) -> None:
    print(f"CHECK {name}: {verdict}: {detail}", flush=True)


def _why_not(fp8: bool) -> str | None:
    """Why this machine cannot run a check (``fp8``: one that needs FP8), or None."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from megatron.core.extensions import transformer_engine as te_ext
        from megatron.core.utils import get_te_version, is_te_min_version
    except ImportError as err:
        return f"megatron-core is missing ({err})"
    if not te_ext.HAVE_TE:
        return "Transformer Engine is not installed (pip install 'megatron-dualpipe[te]')"
    if not is_te_min_version(TE_MIN):
        return (
            f"Transformer Engine {get_te_version()} is older than {TE_MIN} (no "
            "register_wgrad_accumulation_and_reduce_hooks)"
        )
    major, minor = torch.cuda.get_device_capability()
    if fp8 and major < 9:
        return f"FP8 needs compute capability 9.0 (Hopper) or newer, this GPU has {major}.{minor}"
    return None


def _init_distributed() -> None:
    """A one-rank NCCL group and Megatron's parallel state."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(minutes=2))
    parallel_state.initialize_model_parallel()
    megatron_random.model_parallel_cuda_manual_seed(SEED)


# --------------------------------------------------------------------------------------
# 1. TE deferral in DualPipe's order.


def _tiny_te_config(moe: bool, fp8: bool, **overrides: Any) -> Any:
    import torch

    from tests import tiny_models as tm

    experts = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True) if moe else {}
    precision = dict(fp8="hybrid", fp8_recipe="tensorwise") if fp8 else {}
    return tm.tiny_gpt_config(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        use_cpu_initialization=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        **experts,
        **precision,
        **overrides,
    )


def _te_gpt(config: Any, *, pre: bool = True, post: bool = True) -> Any:
    from megatron.core.models.gpt import GPTModel

    from megatron_dualpipe.megatron.model.layer_specs import gpt_chunk_specs
    from tests import tiny_models as tm

    block, _ = gpt_chunk_specs(config, transformer_impl="transformer_engine")
    return GPTModel(config, block, tm.VOCAB_SIZE, tm.SEQ_LENGTH, pre_process=pre, post_process=post)


def _loss(model: Any, batch: dict) -> Any:
    from tests import tiny_models as tm

    return tm._masked_mean(batch["loss_mask"], tm._forward(model, batch)) / 3


def _rel_err(actual: Any, expected: Any) -> float:
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


def _deferral_case(moe: bool, fp8: bool, overlap: bool) -> tuple[float, list[str]]:
    """One comparison (module docstring); the max relative error and the problems."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_dualpipe.megatron.model.chunks import (
        ChunkEnds,
        build_chunks,
        ddp_config,
        model_config,
    )
    from megatron_dualpipe.runtime import WeightGradStore
    from megatron_dualpipe.schedules.registry import SCHEDULES
    from tests import tiny_models as tm

    config = _tiny_te_config(moe, fp8)
    v = SCHEDULES["dualpipev"]
    deferred_config = model_config(config, v, "transformer_engine")
    reference = _te_gpt(config).cuda()
    (deferred,) = build_chunks(
        lambda _: _te_gpt(deferred_config).cuda(), [ChunkEnds(True, True, None)], v
    )
    tm.load_global_state(deferred, tm.global_state(reference))
    fields = dict(overlap_grad_reduce=overlap, grad_reduce_in_fp32=True, bucket_size=40_000)
    ref_ddp = DistributedDataParallel(config, DistributedDataParallelConfig(**fields), reference)
    ddp = DistributedDataParallel(deferred_config, ddp_config(v, **fields), deferred)
    skipped = [p for p in deferred.parameters() if getattr(p, "skip_backward_post_hook", False)]
    problems = [] if skipped else ["no parameter is hooked through its TE layer"]
    batches = [
        {k: v.cuda() for k, v in b.items()}
        for b in tm.synthetic_microbatches(3, micro_batch_size=MICRO_BATCH_SIZE, seed=7)
    ]
    store, worst = WeightGradStore(), 0.0
    for step in range(2):
        ref_ddp.zero_grad_buffer()
        ddp.zero_grad_buffer()
        with ref_ddp.no_sync():
            for batch in batches[:2]:
                _loss(ref_ddp, batch).backward()
        _loss(ref_ddp, batches[2]).backward()
        ref_ddp.finish_grad_sync()
        with store.active():
            losses = [_loss(ddp, b) for b in batches]
        with ddp.no_sync():
            for key in (0, 1):  # B0, B1: dX only
                with store.capture(key):
                    losses[key].backward()
        if any(p.main_grad.any() for p in skipped):
            problems.append(f"step {step}: a deferred main_grad moved during B")
        losses[2].backward()  # BW2, the chunk's last backward (grad sync on)
        with ddp.no_sync():
            store.run(0)
        store.run(1)  # the chunk's last W (grad sync on)
        ddp.finish_grad_sync()
        expected, actual = tm.global_gradients(ref_ddp), tm.global_gradients(ddp)
        if set(actual) != set(expected):
            problems.append(f"step {step}: gradients of {sorted(set(actual) ^ set(expected))}")
        for name in set(actual) & set(expected):
            worst = max(worst, _rel_err(actual[name].float(), expected[name].float()))
    return worst, problems


def _te_deferral(fp8: bool) -> Callable[[argparse.Namespace], tuple[bool, str]]:
    def run(args: argparse.Namespace) -> tuple[bool, str]:
        worst, problems, cases = 0.0, [], 0
        for moe in (False, True):
            for overlap in (False, True):
                error, found = _deferral_case(moe, fp8, overlap)
                worst, cases = max(worst, error), cases + 1
                problems += [f"moe={moe} overlap_grad_reduce={overlap}: {p}" for p in found]
        detail = (
            f"{cases} cases (dense with biases, MoE grouped GEMM; overlap_grad_reduce off and "
            f"on), max relative error {worst:.3e} (tolerance {args.tol:g})"
        )
        if problems:
            return False, f"{detail}; {problems[0]}"
        return worst <= args.tol, detail

    return run


# --------------------------------------------------------------------------------------
# 2. The overlap path's contexts, with FP8's delayed recipe.


def _amax_moved(model: Any) -> tuple[int, int]:
    """(TE layers whose forward amax history is non-zero, TE layers with FP8 metadata)."""
    moved = total = 0
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        if not meta or "scaling_fwd" not in meta:
            continue
        total += 1
        moved += bool(meta["scaling_fwd"].amax_history.abs().sum().item() > 0)
    return moved, total


def _overlap_contexts(args: argparse.Namespace) -> tuple[bool, str]:
    import torch
    from megatron.core.pipeline_parallel.utils import set_streams
    from megatron.core.transformer.module import Float16Module

    from megatron_dualpipe.megatron.schedule.schedule_plan import run_plans, start_forward
    from tests import tiny_models as tm

    def fresh() -> tuple[Any, Any]:
        config = _tiny_te_config(True, False, fp8="hybrid", fp8_recipe="delayed")
        config.overlap_moe_expert_parallel_comm = True  # Megatron asks EP > 1; one GPU: EP=1
        return config, Float16Module(config, _te_gpt(config).cuda())

    batch = {k: v.cuda() for k, v in tm.synthetic_microbatches(1, micro_batch_size=2)[0].items()}

    def ours(model: Any, config: Any) -> None:
        started = start_forward(
            model,
            None,
            iter([batch]),
            forward_step_func=tm.gpt_forward_step,
            config=config,
            is_first_microbatch=True,
            loss_stage=True,
            num_microbatches=1,
            forward_data_store=[],
            collect_non_loss_data=False,
            cp_group_size=1,
        )
        run_plans(started, None)

    def bare(model: Any, config: Any) -> None:
        set_streams()
        inner = model.module
        plan, _ = tm.gpt_forward_step(iter([batch]), inner, return_schedule_plan=True)
        type(plan).run(plan, None)

    counts = {}
    for label, run in (("ours", ours), ("bare", bare)):
        config, model = fresh()
        before = _amax_moved(model)[0]
        run(model, config)
        torch.cuda.synchronize()
        counts[label] = (before, *_amax_moved(model))
    (b0, ours_moved, total), (_, bare_moved, _) = counts["ours"], counts["bare"]
    detail = (
        f"delayed FP8: amax history moved in {ours_moved} of {total} TE layers under "
        f"run_plans, {bare_moved} in the bare plan run"
    )
    return total > 0 and b0 == 0 and ours_moved == total and bare_moved == 0, detail


# --------------------------------------------------------------------------------------
# 3. Per-layer costs at a realistic size.


def _layer_costs(moe: bool) -> Callable[[argparse.Namespace], tuple[bool, str]]:
    def run(args: argparse.Namespace) -> tuple[bool, str]:
        import torch
        import torch.nn.functional as F
        from megatron.core.transformer.transformer_config import TransformerConfig

        from megatron_dualpipe.megatron.model.chunks import ChunkEnds, build_chunks, model_config
        from megatron_dualpipe.planner.memory import MemoryModel
        from megatron_dualpipe.planner.model_cost import ModelShape
        from megatron_dualpipe.runtime import WeightGradStore
        from megatron_dualpipe.schedules.registry import SCHEDULES, generate

        h, s, ffn = args.hidden, args.seq, 14336
        experts = (
            dict(
                num_moe_experts=8,
                moe_router_topk=2,
                moe_ffn_hidden_size=ffn,
                moe_grouped_gemm=True,
                moe_token_dispatcher_type="alltoall",
                moe_router_load_balancing_type="none",
            )
            if moe
            else {}
        )
        # One layer of these sizes, for the layer built and for its cost model alike.
        dims = {
            "num_layers": 1,
            "hidden_size": h,
            "num_attention_heads": 32,
            "num_query_groups": 8,
            "ffn_hidden_size": ffn,
            "normalization": "RMSNorm",
            "add_bias_linear": False,
        }
        config = TransformerConfig(
            **dims,
            gated_linear_unit=True,
            activation_func=F.silu,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
            **experts,
        )
        v = SCHEDULES["dualpipev"]
        config = model_config(config, v, "transformer_engine")
        (model,) = build_chunks(
            lambda _: _te_gpt(config, pre=False, post=False).cuda(),
            [ChunkEnds(False, False, None)],
            v,
        )
        store = WeightGradStore()
        x = torch.randn(s, 1, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)
        times: dict[str, list[float]] = {"F": [], "B": [], "W": []}
        saved = held = 0
        for i in range(args.repeats + 2):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            events[0].record()
            with store.active():
                model.set_input_tensor(x)
                out = model(None, None, None)
            events[1].record()
            torch.cuda.synchronize()
            after_f = torch.cuda.memory_allocated()
            with store.capture(i):
                out.backward(grad)
            events[2].record()
            torch.cuda.synchronize()
            del out
            after_b = torch.cuda.memory_allocated()
            store.run(i)
            events[3].record()
            torch.cuda.synchronize()
            if i >= 2:  # two warm-ups
                for key, (a, b) in zip("FBW", zip(events, events[1:], strict=False), strict=True):
                    times[key].append(a.elapsed_time(b))
                saved, held = after_f - start, after_b - start
            model.zero_grad(set_to_none=True)
            x.grad = None
        f, b, w = (statistics.median(times[k]) for k in "FBW")
        shape = ModelShape(
            **dims,
            seq_length=s,
            vocab_size=128,
            swiglu=True,
            position_embedding_type="rope",
            **({"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": ffn} if moe else {}),
        )
        predicted = MemoryModel(shape, generate("1f1b", 1, 1), tokens=s).stage("t", 0)
        mib = 2**20
        detail = (
            f"{torch.cuda.get_device_name()}, hidden {h}, seq {s}: F {f:.2f} ms, B {b:.2f} ms, "
            f"W {w:.2f} ms -> simulate --cost F={f:.3g},B={b:.3g},W={w:.3g}; saved F->B "
            f"{saved / mib:.0f} MiB (model: {predicted.saved / mib:.0f}), held B->W "
            f"{held / mib:.0f} MiB (model: {predicted.held_for_w / mib:.0f})"
        )
        return w > 0.1 * b, detail

    return run


# --------------------------------------------------------------------------------------
# 4. CUDA graphs: TE's capture in our order, and a graph-safe executor step captured whole.

GRAPH_HIDDEN, GRAPH_TOKENS = 1024, 2048


def _median_ms(run: Callable[[], None], repeats: int) -> float:
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _te_chunks() -> list[Any]:
    """Two one-layer chunks of TE layers deferring their wgrad (``delay_wgrad_compute``)."""
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(SEED)
    return [
        te.Linear(
            GRAPH_HIDDEN, GRAPH_HIDDEN, delay_wgrad_compute=True, params_dtype=torch.float32
        ).cuda()
        for _ in range(2)
    ]


def _play(order: list[float], forward: Callable, backward_dw: Callable, data: Any) -> None:
    """Run ``order`` (TE's convention): ``forward(c, k, x)`` returns chunk c's output for
    its k-th micro-batch; a backward backpropagates it; ``backward_dw(c, k)`` the wgrad of
    chunk c's latest backward (k)."""
    inputs, grads = data
    fwd, bwd, latest, outputs = [0, 0], [0, 0], [0, 0], {}
    for entry in order:
        c = int(abs(entry)) - 1
        if entry > 0:
            outputs[(c, fwd[c])] = forward(c, fwd[c], inputs[c][fwd[c]])
            fwd[c] += 1
        elif entry == int(entry):
            outputs.pop((c, bwd[c])).backward(grads[c][bwd[c]])
            latest[c] = bwd[c]
            bwd[c] += 1
        else:
            backward_dw(c, latest[c])


def _order_case(order: list[float], m: int) -> tuple[float, float, float]:
    """Weight gradients of ``order`` with TE's graphs against the eager run of the same
    order: the max relative error, then eager and graphed ms per step."""
    import torch
    import transformer_engine.pytorch as te

    generator = torch.Generator(device="cuda").manual_seed(SEED)
    shape = (GRAPH_TOKENS, GRAPH_HIDDEN)
    inputs = [
        [
            torch.randn(shape, device="cuda", generator=generator, requires_grad=True)
            for _ in range(m)
        ]
        for _ in range(2)
    ]
    grads = [
        [torch.randn(shape, device="cuda", generator=generator) for _ in range(m)] for _ in range(2)
    ]
    eager = _te_chunks()

    def eager_step() -> None:
        _play(
            order, lambda c, k, x: eager[c](x), lambda c, k: eager[c].backward_dw(), (inputs, grads)
        )

    for layer in eager:
        layer.weight.grad = None
    eager_step()
    reference = [layer.weight.grad.clone() for layer in eager]
    graphed_layers = _te_chunks()
    samples = tuple(
        (inputs[c][k].detach().clone().requires_grad_(),) for c in range(2) for k in range(m)
    )
    graphed = te.make_graphed_callables(
        tuple(graphed_layers), samples, _order=order, _num_layers_per_chunk=[1, 1]
    )

    def graphed_step() -> None:
        _play(
            order,
            lambda c, k, x: graphed[c * m + k](x),
            lambda c, k: graphed[c * m + k].backward_dw(),
            (inputs, grads),
        )

    for layer in graphed_layers:
        layer.weight.grad = None
    graphed_step()
    error = max(
        _rel_err(layer.weight.grad, ref)
        for layer, ref in zip(graphed_layers, reference, strict=True)
    )
    return error, _median_ms(eager_step, 5), _median_ms(graphed_step, 5)


def _graphs_te_order(args: argparse.Namespace) -> tuple[bool, str]:
    """TE's ``make_graphed_callables`` fed :func:`cuda_graph_order` (dualpipev, PP=4, 8
    micro-batches, rank 0: both chunks local, the other ranks' messages stood in by fixed
    tensors) gives the eager gradients; an order the model of TE's rules refuses (rank 1 of
    dualpipev at PP=8: two wgrads of one chunk waiting) is refused or miscaptured by TE too."""
    from megatron_dualpipe.schedules import check_cuda_graph_order, cuda_graph_order
    from megatron_dualpipe.schedules.cuda_graphs import CudaGraphOrderError
    from megatron_dualpipe.schedules.registry import generate

    good = cuda_graph_order(generate("dualpipev", 4, 8), 0)
    check_cuda_graph_order(good, 2, 8, wgrad=True)
    error, eager_ms, graphed_ms = _order_case(good, 8)
    if error > args.tol:
        return False, f"dualpipev PP=4 rank 0 under TE graphs: gradients off by {error:.2e}"
    bad = cuda_graph_order(generate("dualpipev", 8, 16), 1)
    try:
        check_cuda_graph_order(bad, 2, 16, wgrad=True)
        return False, "the model accepts dualpipev PP=8 rank 1's order"
    except CudaGraphOrderError as refusal:
        why = str(refusal)
    try:
        bad_error, _, _ = _order_case(bad, 16)
    except Exception as exc:  # TE refusing it is what the model predicts
        te_says = f"TE refuses it ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    else:
        if bad_error <= args.tol:
            return False, f"TE captures an order the model refuses ({why}): the model is wrong"
        te_says = f"TE miscaptures it (gradients off by {bad_error:.2e})"
    return True, (
        f"dualpipev PP=4 rank 0, 8 micro-batches: gradients within {error:.1e} of eager, "
        f"{eager_ms:.2f} ms eager, {graphed_ms:.2f} ms graphed per step; PP=8 rank 1: {te_says}"
    )


def _buffers_case(schedule: Any, rank: int, reuse: bool | None) -> list[Any]:
    """``rank``'s compute actions of ``schedule`` over two chunks, each a TE-graphed
    ``te.Linear`` (``reuse``: TE's ``_reuse_graph_input_output_buffers``; None: eager)
    followed by an eager ``te.Linear`` deferring its wgrad to the action's W, as our
    executor runs it; the weight gradients of all four layers after the step."""
    import torch
    import transformer_engine.pytorch as te

    from megatron_dualpipe.megatron.grads.te_wgrad import exact_backward_dw
    from megatron_dualpipe.schedules import cuda_graph_order
    from megatron_dualpipe.schedules.ir import Kind

    m = schedule.placement.num_microbatches // 2  # each chunk's micro-batches (the V)
    generator = torch.Generator(device="cuda").manual_seed(SEED)
    shape = (GRAPH_TOKENS, GRAPH_HIDDEN)
    inputs = {
        (c, k): torch.randn(shape, device="cuda", generator=generator, requires_grad=True)
        for c in range(2)
        for k in range(m)
    }
    grads = {key: torch.randn(shape, device="cuda", generator=generator) for key in inputs}
    torch.manual_seed(SEED)
    heads = [
        te.Linear(GRAPH_HIDDEN, GRAPH_HIDDEN, params_dtype=torch.float32).cuda() for _ in range(2)
    ]
    tails = [
        te.Linear(
            GRAPH_HIDDEN, GRAPH_HIDDEN, delay_wgrad_compute=True, params_dtype=torch.float32
        ).cuda()
        for _ in range(2)
    ]
    if reuse is None:
        run = [lambda x, c=c: heads[c](x) for c in range(2) for _ in range(m)]
    else:
        order = [e for e in cuda_graph_order(schedule, rank) if e == int(e)]
        samples = tuple(
            (inputs[(c, k)].detach().clone().requires_grad_(),) for c in range(2) for k in range(m)
        )
        run = te.make_graphed_callables(
            tuple(heads),
            samples,
            _order=order,
            _num_layers_per_chunk=[1, 1],
            _reuse_graph_input_output_buffers=reuse,
        )
    seen, outputs = [0, 0], {}
    for action in schedule.ranks[rank]:
        for half in action.computes:
            c = half.chunk
            if half.kind is Kind.F:
                k = seen[c]
                seen[c] += 1
                outputs[(c, half.microbatch)] = (k, tails[c](run[c * m + k](inputs[(c, k)])))
            if half.kind in (Kind.B, Kind.BW):
                k, out = outputs.pop((c, half.microbatch))
                out.backward(grads[(c, k)])
            if half.kind in (Kind.W, Kind.BW):
                exact_backward_dw(tails[c])
    torch.cuda.synchronize()
    return [layer.weight.grad.clone() for layer in (*heads, *tails)]


def _graphs_te_buffers(args: argparse.Namespace) -> tuple[bool, str]:
    """dualpipev PP=4 rank 3 (whose last Ws wait behind other backwards): each chunk a
    TE-graphed layer, then an eager layer deferring its wgrad, whose W reads the graph's
    output after other graphs replayed. TE keeping every graph's buffers (our helper's
    keywords) gives the eager gradients; TE handing them back to the pool (Megatron's
    ``_reuse_graph_input_output_buffers``) is measured beside it."""
    from megatron_dualpipe.schedules.registry import generate

    schedule = generate("dualpipev", 4, 8)
    eager = _buffers_case(schedule, 3, None)
    kept = _buffers_case(schedule, 3, False)
    reused = _buffers_case(schedule, 3, True)
    error = max(_rel_err(a, b) for a, b in zip(kept, eager, strict=True))
    reuse_error = max(_rel_err(a, b) for a, b in zip(reused, eager, strict=True))
    detail = (
        f"buffers kept (our helper): gradients within {error:.1e} of eager; handed back "
        f"(Megatron's keyword): {reuse_error:.1e}"
    )
    return error <= args.tol, detail


def _graphs_full_step(args: argparse.Namespace) -> tuple[bool, str]:
    """A graph-safe executor step with deferred W (one rank holding both chunks of a
    two-stage pipeline: F0 F1 B1 B0 per micro-batch, every W at the end), captured whole
    with ``torch.cuda.graph`` (as Megatron's FullCudaGraphWrapper captures a step) and
    replayed: losses and gradients equal to the eager step's, and the time per step."""
    import torch

    from megatron_dualpipe.runtime import PipelineExecutor, make_deferrable
    from megatron_dualpipe.schedules.ir import Action, Kind, Placement, Schedule

    m = 8
    actions = [
        Action(kind, stage, mb, stage)
        for mb in range(m)
        for kind, stage in ((Kind.F, 0), (Kind.F, 1), (Kind.B, 1), (Kind.B, 0))
    ] + [Action(Kind.W, stage, mb, stage) for mb in range(m) for stage in (1, 0)]
    schedule = Schedule("local-two-chunks", Placement("loop", 1, 2, m), [actions])
    torch.manual_seed(SEED)

    def chunks() -> list[Any]:
        torch.manual_seed(SEED)
        made = []
        for _ in range(2):
            module = torch.nn.Sequential(
                torch.nn.Linear(GRAPH_HIDDEN, GRAPH_HIDDEN), torch.nn.Tanh()
            ).cuda()
            make_deferrable(module)
            made.append(module)
        return made

    generator = torch.Generator(device="cuda").manual_seed(SEED)
    inputs = [
        torch.randn(GRAPH_TOKENS, GRAPH_HIDDEN, device="cuda", generator=generator)
        for _ in range(m)
    ]

    def loss_fn(out: Any, mb: int) -> Any:
        return (out.float() ** 2).mean() / m

    def executor(modules: list[Any], graph_safe: bool) -> Any:
        return PipelineExecutor(schedule, 0, modules, loss_fn=loss_fn, graph_safe=graph_safe)

    eager_modules = chunks()
    eager = executor(eager_modules, False)
    eager_losses = eager.run(inputs).losses
    eager_grads = [p.grad.clone() for mod in eager_modules for p in mod.parameters()]
    modules = chunks()
    safe = executor(modules, True)
    params = [p for mod in modules for p in mod.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)  # static gradient buffers the graph accumulates into
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            safe.run(inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for p in params:
        p.grad.zero_()
    with torch.cuda.graph(graph):
        captured = safe.run(inputs)
    for p in params:
        p.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    loss_error = max(_rel_err(captured.losses[mb], eager_losses[mb]) for mb in range(m))
    grad_error = max(_rel_err(p.grad, g) for p, g in zip(params, eager_grads, strict=True))
    eager_ms = _median_ms(lambda: eager.run(inputs), 5)
    graphed_ms = _median_ms(graph.replay, 5)
    ok = loss_error <= args.tol and grad_error <= args.tol
    return ok, (
        f"losses within {loss_error:.1e}, gradients within {grad_error:.1e} of the eager step; "
        f"{eager_ms:.2f} ms eager, {graphed_ms:.2f} ms replayed per step"
    )


CHECKS = (
    Check("te-deferral-bf16", "TE deferral in DualPipe's order, bf16", False, _te_deferral(False)),
    Check("te-deferral-fp8", "TE deferral in DualPipe's order, FP8", True, _te_deferral(True)),
    Check("overlap-contexts-fp8", "FP8 on in the F&B overlap path", True, _overlap_contexts),
    Check("layer-costs-dense", "a dense layer's F, B, W and memory", False, _layer_costs(False)),
    Check("layer-costs-moe", "a MoE layer's F, B, W and memory", False, _layer_costs(True)),
    Check(
        "graphs-te-order",
        "TE's CUDA graphs captured in dualpipev's order (PP=4, rank 0) with deferred wgrad",
        False,
        _graphs_te_order,
    ),
    Check(
        "graphs-te-buffers",
        "a deferred W reading a TE graph's output under dualpipev (PP=4, rank 3)",
        False,
        _graphs_te_buffers,
    ),
    Check(
        "graphs-full-step",
        "a graph-safe executor step with deferred W captured whole and replayed",
        False,
        _graphs_full_step,
    ),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="list the checks, run none")
    parser.add_argument("--only", choices=[c.name for c in CHECKS], action="append")
    parser.add_argument("--tol", type=float, default=1e-5, help="deferral: max relative error")
    parser.add_argument("--hidden", type=int, default=4096, help="layer costs: hidden size")
    parser.add_argument("--seq", type=int, default=4096, help="layer costs: tokens per sample")
    parser.add_argument("--repeats", type=int, default=10, help="layer costs: timed passes")
    args = parser.parse_args(argv)
    chosen = [c for c in CHECKS if args.only is None or c.name in args.only]
    reasons = {c.name: _why_not(c.fp8) for c in chosen}
    if args.dry_run:
        for check in chosen:
            reason = reasons[check.name]
            verdict = "CANNOT RUN" if reason else "would run"
            _say(
                check.name,
                verdict,
                f"{reason}; it checks {check.summary}" if reason else check.summary,
            )
        return 0
    if all(reasons.values()):
        for check in chosen:
            _say(check.name, "CANNOT RUN", reasons[check.name])
        return 0
    _init_distributed()
    failed = False
    for check in chosen:
        if reasons[check.name]:
            _say(check.name, "CANNOT RUN", reasons[check.name])
            continue
        try:
            ok, detail = check.run(args)
        except Exception as exc:  # a crash is a failure with its reason
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        _say(check.name, "PASS" if ok else "FAIL", detail)
        failed |= not ok
    import torch.distributed as dist

    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
