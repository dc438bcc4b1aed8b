#!/usr/bin/env python
"""GPU check of weight-gradient deferral on Transformer Engine layers (not part of CI).

Needs CUDA, megatron-core and Transformer Engine >= 2.3. Run from the repository root:

    torchrun --nproc-per-node=2 scripts/gpu_check.py     # TP=2 (sequence parallel on)
    python scripts/gpu_check.py                          # one GPU, TP=1

For a dense GPT and a MoE GPT (4 experts, top-2, TE grouped GEMM) built with Megatron's
TE layer spec, with DDP ``overlap_grad_reduce`` off and on (and with
``gradient_accumulation_fusion`` when APEX's fused kernel is importable), it builds the
model twice from the same weights:

- reference: ``delay_wgrad_compute`` off, Megatron DDP, a plain backward per micro-batch;
- deferred: ``with_delay_wgrad_compute(config)``, ``enable_weight_grad_deferral``, DDP from
  ``ddp_config_for_deferral``; both micro-batches forward under ``store.active()``, each B
  under ``store.capture(k)`` (the first inside ``no_sync``), then the Ws in order.

Two steps of two micro-batches each. It checks that no deferred weight's ``main_grad``
moved during B, that the reduced ``main_grad`` of every parameter equals the reference
(relative error max|a - b| / max|b| <= --tol), and prints one verdict line:
``GPU CHECK PASS`` or ``GPU CHECK FAIL`` with the max relative error (exit 0 / 1), or
``GPU CHECK CANNOT RUN`` with the reason (exit 2).

Then, on one GPU (world 1), the F&B overlap factor: a bf16 MoE GPT block (TE spec, EP=1, so
the all-to-all is local and what overlaps is the two micro-batches' compute on the compute
and communication streams) runs one micro-batch's forward beside another's full backward
through Megatron's schedule plan (``combined_forward_backward_step``), and the same two
halves one after the other. It prints ``OVERLAP FACTOR f`` = time of the overlapped pair /
(forward + backward in sequence), median of --repeats, the value ``megatron-dualpipe
simulate --cost overlap=f`` takes, and checks that the gradients of both orders agree
within --overlap-tol (bf16).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NUM_LAYERS = 2
MICRO_BATCH_SIZE = 2
NUM_MICROBATCHES = 2
STEPS = 2
BUCKET_SIZE = 20_000
SEED = 1234


def _cannot_run(reason: str) -> int:
    print(f"GPU CHECK CANNOT RUN: {reason}", flush=True)
    return 2


def _init_distributed(tp: int | None) -> tuple[int, int, int]:
    """Default group (NCCL) and Megatron's parallel state; returns rank, world, TP."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    if "RANK" not in os.environ:  # plain `python`: a one-rank group
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
        os.environ.setdefault("LOCAL_RANK", "0")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", timeout=timedelta(minutes=2))
    world = dist.get_world_size()
    tp = world if tp is None else tp
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    megatron_random.model_parallel_cuda_manual_seed(SEED)
    return dist.get_rank(), world, tp


def _config(moe: bool, tp: int, fusion: bool) -> Any:
    from megatron_dualpipe.megatron import tiny_models as tm

    experts: dict[str, Any] = {"num_moe_experts": 4, "moe_router_topk": 2} if moe else {}
    if moe:
        experts["moe_grouped_gemm"] = True
    return tm.tiny_gpt_config(
        num_layers=NUM_LAYERS,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        use_cpu_initialization=False,
        gradient_accumulation_fusion=fusion,
        **experts,
    )


def _build(config: Any) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_dualpipe.megatron import tiny_models as tm

    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=bool(config.num_moe_experts)
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=tm.VOCAB_SIZE,
        max_sequence_length=tm.SEQ_LENGTH,
        pre_process=True,
        post_process=True,
    )
    return model.cuda()


def _loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    per_token = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    mask = batch["loss_mask"]
    return (per_token.float() * mask).sum() / mask.sum() / NUM_MICROBATCHES


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


def _run_case(moe: bool, overlap: bool, fusion: bool, tp: int) -> tuple[float, list[str]]:
    """One comparison; returns the max relative error and the problems found."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    from megatron_dualpipe.megatron import tiny_models as tm
    from megatron_dualpipe.megatron.deferral import (
        ddp_config_for_deferral,
        enable_weight_grad_deferral,
        with_delay_wgrad_compute,
    )
    from megatron_dualpipe.runtime import WeightGradStore

    config = _config(moe, tp, fusion)
    deferred_config = with_delay_wgrad_compute(config)
    reference, deferred = _build(config), _build(deferred_config)
    tm.load_global_state(deferred, tm.global_state(reference))
    converted = enable_weight_grad_deferral(deferred)
    problems = [] if converted > 0 else ["no layer was converted"]
    reference_ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=BUCKET_SIZE),
        reference,
    )
    ddp = DistributedDataParallel(
        deferred_config,
        ddp_config_for_deferral(overlap_grad_reduce=overlap, bucket_size=BUCKET_SIZE),
        deferred,
    )
    skipped = [p for p in deferred.parameters() if getattr(p, "skip_backward_post_hook", False)]
    seed = 99 + parallel_state.get_data_parallel_rank()
    batches = [
        {k: v.cuda() for k, v in b.items()}
        for b in tm.synthetic_microbatches(
            NUM_MICROBATCHES, micro_batch_size=MICRO_BATCH_SIZE, seed=seed
        )
    ]
    store = WeightGradStore()
    worst = 0.0
    for step in range(STEPS):
        reference_ddp.zero_grad_buffer()
        ddp.zero_grad_buffer()
        with reference_ddp.no_sync():
            _loss(reference_ddp, batches[0]).backward()
        _loss(reference_ddp, batches[1]).backward()
        reference_ddp.finish_grad_sync()

        with store.active():
            loss0 = _loss(ddp, batches[0])
        with ddp.no_sync(), store.capture(0):
            loss0.backward()
        if any(p.main_grad.any() for p in skipped):
            problems.append(f"step {step}: a deferred weight's main_grad moved during B")
        with store.active():
            loss1 = _loss(ddp, batches[1])
        with store.capture(1):
            loss1.backward()
        store.run(0)
        store.run(1)
        ddp.finish_grad_sync()
        torch.cuda.synchronize()

        expected = tm.global_gradients(reference_ddp)
        actual = tm.global_gradients(ddp)
        if set(actual) != set(expected):
            problems.append(f"step {step}: gradients of {sorted(set(actual) ^ set(expected))}")
        for name in set(actual) & set(expected):
            worst = max(worst, _rel_err(actual[name], expected[name]))
    print(
        f"[rank {dist.get_rank()}] moe={moe} overlap_grad_reduce={overlap} "
        f"fusion={fusion} TP={tp}: {converted} layers deferred, {len(skipped)} params hooked "
        f"through their layer, max relative error {worst:.3e}",
        flush=True,
    )
    return worst, problems


def _overlap_model(hidden: int, seq: int) -> tuple[Any, Any, list[dict[str, torch.Tensor]]]:
    """A bf16 MoE GPT (2 layers, 8 experts, top-2, TE spec) with overlap on, in
    Float16Module, and 4 micro-batches of one sequence of ``seq`` tokens."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dualpipe.megatron import tiny_models as tm

    config = TransformerConfig(
        num_layers=2,
        hidden_size=hidden,
        num_attention_heads=hidden // 128,
        ffn_hidden_size=4 * hidden,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=2 * hidden,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=True,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    # Megatron asks for EP > 1 in __post_init__; one GPU runs the same plan at EP=1.
    config.overlap_moe_expert_parallel_comm = True
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True)
    vocab = 32_000
    model = GPTModel(config, spec, vocab, seq, pre_process=True, post_process=True).cuda()
    model = Float16Module(config, model)
    batches = tm.synthetic_microbatches(4, micro_batch_size=1, seq_length=seq, vocab_size=vocab)
    batches = [{k: v.cuda() for k, v in b.items()} for b in batches]
    return config, model, batches


def _forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> Any:
    from megatron_dualpipe.megatron import tiny_models as tm

    return tm.gpt_forward_step(data_iterator, model, return_schedule_plan)


def _overlap_factor(hidden: int, seq: int, repeats: int, tol: float) -> tuple[float, float, bool]:
    """(overlap factor, gradient relative error, passed); see the module docstring."""
    from megatron.core.pipeline_parallel.combined_1f1b import combined_forward_backward_step
    from megatron.core.pipeline_parallel.utils import set_streams

    config, model, batches = _overlap_model(hidden, seq)
    set_streams()

    def step(forward_mb: int | None, backward: Any) -> Any:
        out, _, _ = combined_forward_backward_step(
            _forward_step,
            iter([batches[forward_mb]]) if forward_mb is not None else None,
            model if forward_mb is not None else None,
            len(batches),
            None,
            [],
            model if backward is not None else None,
            None,
            backward,
            None,
            config,
        )
        return out

    def timed(forward_mb: int | None, backward: Any) -> tuple[float, Any]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step(forward_mb, backward)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), out

    def grads() -> dict[str, torch.Tensor]:
        return {
            n: p.grad.detach().float().clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }

    ratios = []
    for _ in range(repeats):
        model.zero_grad()
        first = step(0, None)
        forward_ms, second = timed(1, None)
        backward_ms, _ = timed(None, first)
        step(None, second)
        reference = grads()
        model.zero_grad()
        first = step(0, None)
        pair_ms, second = timed(1, first)
        step(None, second)
        ratios.append(pair_ms / (forward_ms + backward_ms))
    error = max(_rel_err(g, reference[n]) for n, g in grads().items())
    factor = sorted(ratios)[len(ratios) // 2]
    return factor, error, error <= tol


def _preflight() -> str | None:
    """Why this machine cannot run the check, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import megatron.core.extensions.transformer_engine as te_ext
        from megatron.core.utils import get_te_version, is_te_min_version
    except ImportError as error:
        return f"megatron-core or Transformer Engine is missing ({error})"
    if not te_ext.HAVE_TE:
        return "Transformer Engine is not installed"
    if not is_te_min_version("2.3.0"):
        return f"Transformer Engine {get_te_version()} < 2.3 has no delay_wgrad_compute"
    return None


def _fusion_available() -> bool:
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=None, help="tensor parallel size (world)")
    parser.add_argument("--tol", type=float, default=1e-5, help="max relative error")
    parser.add_argument("--overlap-hidden", type=int, default=2048, help="F&B overlap block width")
    parser.add_argument("--overlap-seq", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed F&B pairs (median)")
    parser.add_argument("--overlap-tol", type=float, default=1e-2, help="bf16 gradient error")
    args = parser.parse_args()
    reason = _preflight()
    if reason is not None:
        return _cannot_run(reason)
    rank, world, tp = _init_distributed(args.tp)
    fusions = [False, True] if _fusion_available() else [False]
    worst, problems = 0.0, []
    for moe in (False, True):
        for overlap in (False, True):
            for fusion in fusions:
                try:
                    error, found = _run_case(moe, overlap, fusion, tp)
                except Exception as exc:  # a crash is a failure with its reason
                    error, found = float("inf"), [f"moe={moe} overlap={overlap}: {exc!r}"]
                worst = max(worst, error)
                problems += found
    verdict = torch.tensor([worst, float(len(problems))], dtype=torch.float64, device="cuda")
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    worst, failed = verdict[0].item(), verdict[1].item() > 0
    for problem in problems:
        print(f"[rank {rank}] problem: {problem}", flush=True)
    ok = not failed and worst <= args.tol
    if rank == 0:
        word = "PASS" if ok else "FAIL"
        print(
            f"GPU CHECK {word}: max relative error {worst:.3e} (tolerance {args.tol:g}), "
            f"world {world}, TP {tp}, fusion runs: {fusions[-1]}",
            flush=True,
        )
    if world == 1:
        try:
            factor, error, same = _overlap_factor(
                args.overlap_hidden, args.overlap_seq, args.repeats, args.overlap_tol
            )
        except Exception as exc:  # a crash is a failure with its reason
            print(f"OVERLAP CHECK FAIL: {exc!r}", flush=True)
            ok = False
        else:
            print(
                f"OVERLAP FACTOR {factor:.3f} (hidden {args.overlap_hidden}, seq "
                f"{args.overlap_seq}, {torch.cuda.get_device_name()}); gradients overlapped vs "
                f"sequential: max relative error {error:.3e} ({'PASS' if same else 'FAIL'})",
                flush=True,
            )
            ok = ok and same
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
