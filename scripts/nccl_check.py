#!/usr/bin/env python
"""NCCL checks, what to run first on a multi-GPU machine (not part of CI; it has not run:
no multi-GPU machine was available, and NCCL refuses two ranks of one communicator on one
GPU). One process per GPU, through torchrun:

    torchrun --nproc-per-node 2 scripts/nccl_check.py    # the PP=2 checks
    torchrun --nproc-per-node 8 scripts/nccl_check.py    # all (PP=4 on ranks 0-3 and 4-7)
    python scripts/nccl_check.py --dry-run               # the checks and what each needs

Each check prints one line on rank 0, ``CHECK <name>: PASS: ...``, ``CHECK <name>: FAIL:
...`` or ``CHECK <name>: CANNOT RUN: <reason>``. Exit code: 1 when a check failed, else 0
(a check that cannot run is not a failure; ``--dry-run`` always 0). Needs CUDA, NCCL and
at least as many GPUs (processes) as the check's pipeline has ranks, and (but for
``rank-killed``) megatron-core: the world is made as Megatron-LM makes it, Megatron's
``initialize_model_parallel`` with our placement's embedding ranks, which leaves a
pipeline's ranks holding different numbers of process groups (rank 0 more), and every
pipeline runs the check on Megatron's pipeline group.

- ``dualpipev-pp2``, ``dualpipev-pp4``, ``dualpipe-pp4``: one training step of a small
  stack of stages (projection or norm, linear, tanh, linear, as in
  tests/test_runtime_executor.py) through :class:`~megatron_dualpipe.runtime.PipelineExecutor`
  on NCCL, against the same model run unpipelined on each rank: every loss and every
  parameter gradient within ``--tol`` (relative; dualpipe's two copies summed first).
- ``shared-streams``: the dualpipev PP=2 step again after drawing 32 CUDA streams of each
  priority (``torch.cuda.Stream()``): PyTorch's pool holds 32 per priority, handed out in
  turn, so the pipeline communicator's stream, drawn next (NCCL makes the communicator at
  its first use), is one of them (31 fill the pool
  with the communicator's own; the 32nd makes it shared whatever drew before). The
  lock-step plan must finish and give the same losses. The drawn streams sit idle: this
  shows the plan finishing on a shared stream, not under contention.
- ``rank-killed``: rank 0 starts two processes of its own (GPUs 0 and 1), kills the second
  with SIGKILL in the middle of a step, and expects the first to raise within ``--timeout``
  naming rank 1, and both processes to be gone.
- ``mirror``: dualpipe PP=2 (partner ranks 0 and 1): after the step the two copies of each
  stage hold the same summed gradient, equal to the unpipelined one; summed in 20 KiB
  buckets, of which stage 0 (a projection) fills more than stage 1 (a norm), as two stages
  of a real model do at the default 64 MiB.
- ``mirror-distributed-optimizer``: the same with every chunk wrapped in Megatron DDP with
  the distributed optimizer (``main_grad`` in DDP's buffers, ``disable_bucketing``) on
  Megatron's own pipeline groups (one data-parallel rank), summed by
  ``megatron_dualpipe.megatron.grads.mirror``; needs megatron-core.
- ``nccl-memory``: dualpipe PP=2; the device memory in use outside PyTorch's caching
  allocator (``torch.cuda.mem_get_info`` less ``memory_reserved``: what nvidia-smi shows,
  less PyTorch's own) before and after the pipeline communicator's creation and first
  step (Megatron's pipeline group, whose communicator NCCL makes at its first use), then
  after the mirror exchange's, beside the estimate of
  ``planner/nccl_memory.py`` for each; PASS reports both (a measurement, no bound).
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, BATCH, MICROBATCHES_PER_RANK = 64, 4, 4
MIB = 2**20


@dataclass(frozen=True)
class Check:
    name: str
    summary: str
    ranks: int  # GPUs (processes) the check's pipeline needs
    megatron: bool
    run: Callable[[argparse.Namespace, Any], tuple[bool, str]]


def _say(name: str, verdict: str, detail: str) -> None:
    print(f"CHECK {name}: {verdict}: {detail}", flush=True)


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _why_not(check: Check) -> str | None:
    """Why this machine (or this launch) cannot run ``check``, or None."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "no CUDA device"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    if check.megatron:
        try:
            import megatron.core  # noqa: F401
        except ImportError as err:
            return f"megatron-core is missing ({err})"
    world = _world()
    if world < check.ranks or world % check.ranks:
        return (
            f"it needs a multiple of {check.ranks} processes, one per GPU, got {world}: run "
            f"torchrun --nproc-per-node {check.ranks} scripts/nccl_check.py"
        )
    if torch.cuda.device_count() < min(check.ranks, int(os.environ.get("LOCAL_WORLD_SIZE", 1))):
        return f"fewer GPUs ({torch.cuda.device_count()}) than processes on this node"
    return None


# --------------------------------------------------------------------------------------
# The model, its data and the unpipelined reference (as tests/test_runtime_executor.py).


def _stages(count: int, device: Any) -> list[Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    out = []
    for s in range(count):
        first = nn.Linear(HIDDEN, HIDDEN, bias=False) if s == 0 else nn.LayerNorm(HIDDEN)
        out.append(
            nn.Sequential(first, nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN))
        )
    return [s.to(device) for s in out]


def _data(microbatches: int, device: Any) -> tuple[list[Any], list[Any]]:
    import torch

    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(BATCH, HIDDEN, generator=generator) for _ in range(microbatches)]
    targets = [torch.randn(BATCH, HIDDEN, generator=generator) for _ in range(microbatches)]
    return [x.to(device) for x in inputs], [t.to(device) for t in targets]


def _loss_fn(targets: list[Any]) -> Callable[[Any, int], Any]:
    return lambda output, mb: ((output - targets[mb]) ** 2).mean()


def _reference(stages: int, microbatches: int, device: Any) -> tuple[dict, dict]:
    """Losses per micro-batch and gradients per model stage, no pipeline."""
    model = _stages(stages, device)
    inputs, targets = _data(microbatches, device)
    losses = {}
    for mb, x in enumerate(inputs):
        for stage in model:
            x = stage(x)
        loss = _loss_fn(targets)(x, mb)
        loss.backward()
        losses[mb] = loss.detach()
    return losses, {s: [p.grad for p in m.parameters()] for s, m in enumerate(model)}


def _rel(actual: Any, expected: Any) -> float:
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


@dataclass
class _Ctx:
    """This process's place: its global rank, its pipeline's group and ranks, its device."""

    rank: int
    pipeline_rank: int
    group: Any
    device: Any


def _pipeline(size: int, schedule: str) -> _Ctx:
    """The world as Megatron-LM makes it for ``schedule`` at PP ``size``: Megatron's
    ``initialize_model_parallel`` with our placement's embedding ranks (made again for each
    check), which leaves the pipeline's ranks holding different numbers of process groups,
    as on a cluster; the plan runs on its pipeline group. (Without CUDA, the CPU: the
    suite runs the checks' logic over gloo.)"""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dualpipe.megatron.model.placement import embedding_ranks
    from megatron_dualpipe.schedules.registry import SCHEDULES

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    ranks = embedding_ranks(SCHEDULES[schedule])
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=size,
        **({"get_embedding_ranks": ranks} if ranks else {}),
    )
    return _Ctx(
        dist.get_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_group(),
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu"),
    )


def _step(
    schedule_name: str,
    pp: int,
    args: argparse.Namespace,
    ctx: _Ctx,
    wrap: Callable | None = None,
    prepare: Callable | None = None,
) -> tuple[list[Any], Any, dict, list[Any]]:
    """One step on this rank: (its chunk modules, the placement, its losses, what ``wrap``
    made of them; ``prepare`` sees those before the step)."""
    from megatron_dualpipe.runtime import PipelineExecutor, TensorSpec
    from megatron_dualpipe.schedules.registry import generate

    microbatches = MICROBATCHES_PER_RANK * pp
    schedule = generate(schedule_name, pp, microbatches)
    p = schedule.placement
    stages = _stages(p.num_model_stages, ctx.device)
    modules = []
    for chunk in range(p.num_chunks):
        module = stages[p.model_stage(p.stage_of(ctx.pipeline_rank, chunk))]
        modules.append(copy.deepcopy(module) if p.kind == "mirror" and chunk == 1 else module)
    wrapped = [wrap(m) for m in modules] if wrap else modules
    if prepare:
        prepare(wrapped)
    inputs, targets = _data(microbatches, ctx.device)
    executor = PipelineExecutor(
        schedule,
        ctx.pipeline_rank,
        modules,  # a DDP wrapper's hooks sit on these modules' parameters
        specs=dict.fromkeys(range(p.num_stages), TensorSpec((BATCH, HIDDEN))),
        loss_fn=_loss_fn(targets),
        group=ctx.group,
        defer_weight_grads=wrap is None,
        timeout_s=args.timeout,
    )
    result = executor.run(inputs)
    return modules, p, result.losses, wrapped


def _compare(
    modules: list[Any], p: Any, losses: dict, ctx: _Ctx, args: argparse.Namespace, grad_of: Callable
) -> tuple[bool, str]:
    """This rank's losses and chunk gradients against the reference; one verdict for all
    ranks of the pipeline (the worst error, gathered)."""
    import torch
    import torch.distributed as dist

    microbatches = MICROBATCHES_PER_RANK * p.num_ranks
    ref_losses, ref_grads = _reference(p.num_model_stages, microbatches, ctx.device)
    worst = max([_rel(v, ref_losses[mb]) for mb, v in losses.items()], default=0.0)
    for chunk, module in enumerate(modules):
        stage = p.model_stage(p.stage_of(ctx.pipeline_rank, chunk))
        for param, ref in zip(module.parameters(), ref_grads[stage], strict=True):
            worst = max(worst, _rel(grad_of(param), ref))
    found = torch.tensor([worst], device=ctx.device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=ctx.group)
    err = found.item()
    return (
        err <= args.tol,
        f"max relative error {err:.2e} over losses and gradients (tol {args.tol:g})",
    )


def _schedule_check(
    name: str, pp: int, mirror_bucket_bytes: int | None = None
) -> Callable[[argparse.Namespace, Any], tuple[bool, str]]:
    """One step of ``name`` at PP ``pp`` against the reference; dualpipe's copies summed
    in buckets of ``mirror_bucket_bytes`` (None: the runtime's default)."""

    def run(args: argparse.Namespace, _: Any) -> tuple[bool, str]:
        from megatron_dualpipe.runtime import sync_mirror_grads
        from megatron_dualpipe.runtime.mirror import param_buckets, param_grad

        ctx = _pipeline(pp, name)
        modules, p, losses, _ = _step(name, pp, args, ctx)
        if p.kind == "mirror":
            sync_mirror_grads(
                modules,
                p,
                ctx.pipeline_rank,
                group=ctx.group,
                timeout_s=args.timeout,
                buckets=None
                if mirror_bucket_bytes is None
                else lambda m: param_buckets(m, param_grad, bucket_bytes=mirror_bucket_bytes),
            )
        return _compare(modules, p, losses, ctx, args, lambda param: param.grad)

    return run


def _shared_streams(args: argparse.Namespace, _: Any) -> tuple[bool, str]:
    import torch

    # PyTorch's pool holds 32 streams per priority, handed out in turn: after 32 draws of
    # each, whatever is drawn next (the pipeline communicator's stream, high priority)
    # is one of these, whatever drew before.
    drawn = [torch.cuda.Stream(priority=p) for p in (0, -1) for _ in range(32)]
    ok, detail = _schedule_check("dualpipev", 2)(args, None)
    return ok, f"{len(drawn)} streams drawn first (32 per priority); {detail}"


def _mirror_distributed(args: argparse.Namespace, _: Any) -> tuple[bool, str]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_dualpipe.megatron.grads.mirror import (
        mirror_pair,
        prepare_mirrors,
        sync_mirror_gradients,
    )

    # Megatron's own groups, PP=2 and one data-parallel rank (the rest of the world as
    # tensor-parallel ranks that run the same pipeline), so that the distributed
    # optimizer's reduce-scatter leaves each rank the whole of its buffers to compare.
    pp, tp = 2, dist.get_world_size() // 2
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    group = parallel_state.get_pipeline_model_parallel_group()
    device = torch.device("cuda", torch.cuda.current_device())
    ctx = _Ctx(dist.get_rank(), parallel_state.get_pipeline_model_parallel_rank(), group, device)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4 * tp,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True
    )

    def wrap(module: Any) -> Any:
        return DistributedDataParallel(config, ddp_config, module, disable_bucketing=True)

    def prepare(wrapped: list[Any]) -> None:
        prepare_mirrors(wrapped, group=group, timeout_s=args.timeout)

    modules, p, losses, wrapped = _step("dualpipe", pp, args, ctx, wrap, prepare)
    for ddp in wrapped:
        ddp.finish_grad_sync()
    sync_mirror_gradients(wrapped, mirror_pair(group, timeout_s=args.timeout))
    ok, detail = _compare(modules, p, losses, ctx, args, lambda param: param.main_grad)
    return ok, f"Megatron DDP, distributed optimizer, main_grad: {detail}"


class _Blocking:
    """Wraps a stage so that its forward signals ``started`` and sleeps: the process is
    then mid-step, its peer waiting on it."""

    def __init__(self, started: Any):
        self.started = started

    def __call__(self, module: Any) -> Any:
        started = self.started

        def forward_pre_hook(*_: Any) -> None:
            started.set()
            time.sleep(3600)  # killed here

        module.register_forward_pre_hook(forward_pre_hook)
        return module


def _rank_killed_child(rank: int, port: int, started: Any, told: Any, timeout: float) -> None:
    """One of rank-killed's two processes: a dualpipev PP=2 step whose rank 1 blocks in its
    first forward; rank 0 puts what it raised (or that it finished) on ``told``."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()  # else gloo on the CPU (to try the check's logic)
    if cuda:
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=2)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    ctx = _Ctx(rank, rank, dist.new_group([0, 1]), device)
    wrap = _Blocking(started) if rank == 1 else None
    try:
        _step("dualpipev", 2, argparse.Namespace(timeout=timeout), ctx, wrap)
    except Exception as err:
        told.put(f"{type(err).__name__}: {err}")
        told.close()
        told.join_thread()
        os._exit(3)
    told.put("")
    os._exit(0)


def _rank_killed(args: argparse.Namespace, _: Any) -> tuple[bool, str]:
    import multiprocessing as mp
    import queue

    import torch.distributed as dist

    if dist.get_rank() != 0:
        return True, "run by rank 0"
    context = mp.get_context("spawn")
    started, told = context.Event(), context.Queue()
    port = 29600 + os.getpid() % 1000
    procs = [
        context.Process(target=_rank_killed_child, args=(r, port, started, told, args.timeout))
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    if not started.wait(300):
        for proc in procs:
            proc.kill()
        return False, "rank 1 never reached its first forward"
    time.sleep(2)  # rank 0 is in the step, waiting on rank 1
    os.kill(procs[1].pid, signal.SIGKILL)
    limit = 2 * args.timeout + 60
    try:
        raised = told.get(timeout=limit)
    except queue.Empty:
        raised = None
    for proc in procs:
        proc.join(30)
    alive = [r for r, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    if raised is None:
        return False, f"rank 0 said nothing {limit:.0f} s after rank 1 was killed"
    if alive:
        return False, f"ranks {alive} still running after rank 0 raised: {raised}"
    if "rank 1" not in raised:
        return False, f"rank 0 did not name rank 1: {raised or 'it finished the step'}"
    return True, f"rank 0 raised {raised}; every process gone"


def _nccl_memory(args: argparse.Namespace, _: Any) -> tuple[bool, str]:
    import torch

    from megatron_dualpipe.planner.nccl_memory import NcclBuffers, nccl_memory
    from megatron_dualpipe.runtime import sync_mirror_grads
    from megatron_dualpipe.schedules.registry import generate

    def taken() -> int:
        """Device memory in use outside PyTorch's caching allocator (NCCL's, mostly)."""
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()

    pp = 2
    ctx = _pipeline(pp, "dualpipe")
    warm = torch.ones(8, 8, device=ctx.device)
    (warm @ warm).sum().item()  # cuBLAS's handle before the first reading, not in it
    start = taken()
    modules, p, _, _ = _step("dualpipe", pp, args, ctx)  # makes the pipeline communicator
    after_step = taken()
    sync_mirror_grads(modules, p, ctx.pipeline_rank, group=ctx.group, timeout_s=args.timeout)
    after_mirror = taken()
    schedule = generate("dualpipe", pp, MICROBATCHES_PER_RANK * pp)
    estimate = {
        c.comm: c.bytes
        for c in nccl_memory(schedule, NcclBuffers.from_env(os.environ))[ctx.pipeline_rank]
    }
    measured = {"pipeline": after_step - start, "mirror": after_mirror - after_step}
    parts = [
        f"{name} {measured[name] / MIB:.0f} MiB (estimate {estimate.get(name, 0) / MIB:.0f})"
        for name in measured
    ]
    return True, (
        f"rank {ctx.rank}, memory outside the caching allocator taken by each communicator's "
        f"creation and first use: {', '.join(parts)}"
    )


def _check(name: str, summary: str, ranks: int, run: Callable, megatron: bool = True) -> Check:
    return Check(name, summary, ranks, megatron, run)


CHECKS = (
    _check(
        "dualpipev-pp2",
        "dualpipev at PP 2 against the unpipelined losses and gradients",
        2,
        _schedule_check("dualpipev", 2),
    ),
    _check(
        "dualpipev-pp4",
        "dualpipev at PP 4 against the unpipelined losses and gradients",
        4,
        _schedule_check("dualpipev", 4),
    ),
    _check(
        "dualpipe-pp4",
        "dualpipe at PP 4 against the unpipelined losses and gradients",
        4,
        _schedule_check("dualpipe", 4),
    ),
    _check(
        "shared-streams",
        "dualpipev at PP 2 after 32 streams per priority (the whole pool) were drawn",
        2,
        _shared_streams,
    ),
    _check(
        "rank-killed",
        "a rank killed mid-step is named and every process ends",
        2,
        _rank_killed,
        megatron=False,
    ),
    _check(
        "mirror",
        "dualpipe's mirror gradient sum without the distributed optimizer, in 20 KiB buckets "
        "(stage 0 fills more of them than stage 1: each rank's two chunks differ in count)",
        2,
        _schedule_check("dualpipe", 2, mirror_bucket_bytes=20 * 1024),
    ),
    _check(
        "mirror-distributed-optimizer",
        "the mirror gradient sum under Megatron DDP with the distributed optimizer",
        2,
        _mirror_distributed,
    ),
    _check(
        "nccl-memory",
        "free GPU memory around the pipeline communicator beside the estimate",
        2,
        _nccl_memory,
    ),
)


def _init_distributed(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs, as the reference's
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl", timeout=timedelta(seconds=10 * args.timeout + 300))


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line: which checks, the tolerance of the comparisons, a rank's wait."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="list the checks, run none")
    parser.add_argument("--only", choices=[c.name for c in CHECKS], action="append")
    parser.add_argument("--tol", type=float, default=1e-5, help="max relative error")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a rank waits")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    chosen = [c for c in CHECKS if args.only is None or c.name in args.only]
    reasons = {c.name: _why_not(c) for c in chosen}
    if args.dry_run:
        for check in chosen:
            reason = reasons[check.name]
            needs = f"{check.ranks} GPUs" + (" and megatron-core" if check.megatron else "")
            if reason:
                _say(
                    check.name, "CANNOT RUN", f"{reason}; it checks {check.summary} (needs {needs})"
                )
            else:
                _say(check.name, "would run", f"{check.summary} (needs {needs})")
        return 0
    if all(reasons.values()):
        for check in chosen:
            _say(check.name, "CANNOT RUN", reasons[check.name])
        return 0
    import torch.distributed as dist

    _init_distributed(args)
    failed = False
    for check in chosen:
        if reasons[check.name]:
            if dist.get_rank() == 0:
                _say(check.name, "CANNOT RUN", reasons[check.name])
            continue
        try:
            ok, detail = check.run(args, None)
        except Exception as exc:  # a crash is a failure with its reason
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, (ok, detail))
        if dist.get_rank() == 0:
            bad = [(r, d) for r, (good, d) in enumerate(verdicts) if not good]
            if bad:
                _say(check.name, "FAIL", "; ".join(f"rank {r}: {d}" for r, d in bad))
            else:
                _say(check.name, "PASS", detail)
        failed |= any(not good for good, _ in verdicts)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
