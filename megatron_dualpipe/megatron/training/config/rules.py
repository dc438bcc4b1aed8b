"""The rules a training config must meet before any rank starts: one ``(key, what to
change)`` problem per check, raised as a :class:`~.keys.ConfigError` naming where the key's
value came from. No torch or megatron import."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

from ....planner.model_cost import Recompute
from ....schedules.config_values import override_origins
from ....schedules.cuda_graphs import cuda_graph_problem, ep_overlap_graph_problem
from ....schedules.limits import (
    MAX_TRAIN_SIZE,
    optimize_size_problem,
    schedule_size,
    train_size_problem,
)
from ....schedules.registry import OUR_SCHEDULES, SCHEDULES
from ....schedules.saved import saved_schedule_problem
from ...schedule.checks import DualPipeConfigError, overlap_problem, schedule_spec
from .data_rules import check_data, check_tokenizer
from .keys import CHOICES, OPTIMIZE_AFTER, TYPES, ConfigError, Problem, TrainConfig, base_type
from .run_name import run_name_problem

__all__ = [
    "ConfigSource",
    "blame",
    "config_source",
    "schedule_file_problem",
    "validated",
]


def validated(
    cfg: TrainConfig, source: str, origins: Mapping[str, str] | None = None
) -> TrainConfig:
    """``cfg`` if it can run; else ConfigError with where the key's value came from
    (``origins``, else ``source``), the key and the fix."""
    checks = (
        _check_values,
        _check_parallel,
        _check_sizes,
        _check_model,
        _check_schedule,
        _check_schedule_order,
        _check_overlap,
        _check_recompute,
        _check_cuda_graphs,
        check_data,
        check_tokenizer,
        _check_io,
    )
    origins = origins or {}
    for check in checks:
        problem = check(cfg)
        if problem is not None:
            key, message = problem
            raise ConfigError(f"{_where(key, source, origins)}: {key}: {message}")
    return cfg


def _where(key: str, source: str, origins: Mapping[str, str]) -> str:
    """Where a problem with ``key`` comes from: the flag or --set that gave ``key``; else,
    where one gave a key the problem also depends on (:data:`_RELATED`), ``source`` with
    it; else ``source``."""
    if key in origins:
        return origins[key]
    related = [origins[k] for k in _RELATED.get(key, ()) if k in origins]
    if related and related[0] not in source:
        return f"{source} with {related[0]}"
    return source


class ConfigSource(str):
    """A config's name, as errors start with it (the string itself), that knows which
    keys the command line gave: ``origins`` maps each to its ``--set key=value``
    (:func:`~...schedules.config_values.override_origins`), for :func:`blame`."""

    origins: Mapping[str, str]

    def __new__(cls, name: str | Path, origins: Mapping[str, str] | None = None) -> ConfigSource:
        made = super().__new__(cls, str(name))
        made.origins = dict(origins or {})
        return made


def config_source(path: str | Path, overrides: Iterable[str] = ()) -> ConfigSource:
    """The :class:`ConfigSource` of a config file read with ``overrides`` (``--set``)."""
    return ConfigSource(path, override_origins(path, list(overrides))[1])


def blame(source: str, key: str) -> str:
    """What an error about ``key`` starts with: the ``--set`` that gave ``key`` where
    ``source`` is a :class:`ConfigSource` knowing one (as :func:`_where` chooses), else
    ``source``."""
    return _where(key, str(source), getattr(source, "origins", {}))


#: Keys whose values a problem reported under the key also depends on: where the key
#: itself was not set by a flag or --set, the error names the first of these that was.
_RELATED: dict[str, tuple[str, ...]] = {
    "lr_warmup_iters": ("lr_decay_iters", "train_iters"),
    "world_size": ("tensor_model_parallel_size", "pipeline_model_parallel_size"),
    "global_batch_size": ("micro_batch_size", "world_size", "tensor_model_parallel_size"),
    "num_attention_heads": ("hidden_size", "tensor_model_parallel_size"),
    "expert_model_parallel_size": ("num_experts", "world_size"),
    "pipeline_schedule": ("pipeline_model_parallel_size", "global_batch_size", "num_layers"),
}


def _check_values(cfg: TrainConfig) -> Problem:
    for key, choices in CHOICES.items():
        if getattr(cfg, key) not in choices:
            names = ", ".join(c for c in choices if c is not None)
            return key, f"{getattr(cfg, key)!r} is not one of {names}"
    for name, tp in TYPES.items():
        value = getattr(cfg, name)
        base, _ = base_type(tp)
        if base is int and value is not None and value < _minimum(name):
            return name, f"must be >= {_minimum(name)}, got {value}"
        if base is int and value is not None and value > _maximum(name):
            return name, f"must be at most {_maximum(name):,}, got {value:,}"
        if base is float and value is not None and (value < 0 or not math.isfinite(value)):
            return name, f"must be a finite number >= 0, got {value}"
    if cfg.min_lr > cfg.lr:
        return "min_lr", f"must not exceed lr ({cfg.lr}), got {cfg.min_lr}"
    decay = cfg.lr_decay_iters or cfg.train_iters
    if cfg.lr_warmup_iters >= decay:
        return "lr_warmup_iters", f"must be below the decay iterations ({decay})"
    return None


def _minimum(name: str) -> int:
    """Smallest legal value of an integer key."""
    return 0 if name in ("seed", "eval_iters", "lr_warmup_iters", "cuda_graph_warmup_steps") else 1


def _maximum(name: str) -> int:
    """Largest legal value of an integer key: what a C int holds (the widest Megatron-Core
    and torch take for sizes and counts; with it, iterations x samples per step stay within
    the int64 sample index of the data), a 64-bit seed."""
    return 2**63 - 1 if name == "seed" else 2**31 - 1


def _check_sizes(cfg: TrainConfig) -> Problem:
    """A step whose schedule (or list of micro-batches, under Megatron's schedules) is
    larger than train builds on a rank (:func:`~...schedules.limits.train_size_problem`)."""
    m, pp = cfg.num_microbatches, cfg.pipeline_model_parallel_size
    vpp = cfg.virtual_pipeline_model_parallel_size
    problem = train_size_problem(pp, m, vpp)
    if problem is not None:
        per_step = cfg.micro_batch_size * cfg.data_parallel_size
        most = MAX_TRAIN_SIZE // schedule_size(pp, 1, vpp) * per_step
        return "global_batch_size", (
            f"{cfg.global_batch_size} makes {m} micro-batches per step (global_batch_size / "
            f"(micro_batch_size x data-parallel size)), and {problem}: lower global_batch_size "
            f"to at most {most:,} here, or raise micro_batch_size"
        )
    return None


def _check_parallel(cfg: TrainConfig) -> Problem:
    tp, pp, ep = (
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
        cfg.expert_model_parallel_size,
    )
    world = cfg.launch_world_size
    if world % (tp * pp):
        return "world_size", (
            f"{world} ranks do not split into tensor x pipeline groups of {tp} x {pp}: "
            f"use a multiple of {tp * pp}"
        )
    dp = cfg.data_parallel_size
    if cfg.global_batch_size % (cfg.micro_batch_size * dp):
        return "global_batch_size", (
            f"{cfg.global_batch_size} is not divisible by micro_batch_size x data-parallel "
            f"size = {cfg.micro_batch_size} x {dp}"
        )
    if ep > 1 and not cfg.is_moe:
        return "expert_model_parallel_size", "needs num_experts (a MoE model) when above 1"
    if dp % ep:
        return "expert_model_parallel_size", (
            f"{ep} must divide the data-parallel size {dp} (world_size / (TP x PP))"
        )
    if cfg.sequence_parallel and tp == 1:
        return "sequence_parallel", "needs tensor_model_parallel_size > 1"
    return None


def _check_model(cfg: TrainConfig) -> Problem:
    tp = cfg.tensor_model_parallel_size
    if cfg.hidden_size % cfg.num_attention_heads:
        return "num_attention_heads", (
            f"{cfg.num_attention_heads} does not divide hidden_size {cfg.hidden_size}"
        )
    if cfg.num_attention_heads % tp:
        return "num_attention_heads", f"must be divisible by tensor_model_parallel_size {tp}"
    groups = cfg.num_query_groups
    if groups is not None and (cfg.num_attention_heads % groups or groups % tp):
        return "num_query_groups", (
            f"{groups} must divide num_attention_heads {cfg.num_attention_heads} and be "
            f"divisible by tensor_model_parallel_size {tp}"
        )
    if (cfg.max_position_embeddings or cfg.seq_length) < cfg.seq_length:
        return "max_position_embeddings", f"must be >= seq_length {cfg.seq_length}"
    if cfg.is_moe:
        if cfg.num_experts % cfg.expert_model_parallel_size:
            return "num_experts", (
                f"{cfg.num_experts} is not divisible by expert_model_parallel_size "
                f"{cfg.expert_model_parallel_size}"
            )
        if cfg.moe_router_topk > cfg.num_experts:
            return "moe_router_topk", f"must not exceed num_experts {cfg.num_experts}"
        if cfg.add_bias_linear:
            return "add_bias_linear", (
                "MoE layers of Megatron-Core's local spec fail with biased linears "
                "(SequentialMLP, 0.16.1): set add_bias_linear: false"
            )
    return _check_model_features(cfg)


def _check_model_features(cfg: TrainConfig) -> Problem:
    """Dense-then-MoE, router and MLA keys."""
    if cfg.moe_layer_freq is not None:
        if not cfg.is_moe:
            return "moe_layer_freq", "needs num_experts (a MoE model)"
        try:
            pattern = cfg.moe_layer_pattern
            if isinstance(pattern, list) and any(x not in (0, 1) for x in pattern):
                raise ValueError(cfg.moe_layer_freq)
        except ValueError:
            return "moe_layer_freq", (
                f"{cfg.moe_layer_freq!r} is neither an integer nor a sum of 0/1 lists such as "
                "[0]*3+[1]*58"
            )
        if isinstance(pattern, int) and pattern < 1:
            return "moe_layer_freq", f"must be >= 1, got {pattern}"
        if isinstance(pattern, list) and len(pattern) != cfg.num_layers:
            return "moe_layer_freq", (
                f"lists {len(pattern)} layers but num_layers is {cfg.num_layers}: give one 0 "
                "(dense) or 1 (MoE) per layer"
            )
    if cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function != "sigmoid":
        return "moe_router_enable_expert_bias", (
            "needs moe_router_score_function: sigmoid (as in Megatron-Core)"
        )
    if not cfg.multi_latent_attention and (cfg.q_lora_rank is not None or cfg.rope_type):
        key = "q_lora_rank" if cfg.q_lora_rank is not None else "rope_type"
        return key, "is a multi-latent attention key: set multi_latent_attention: true"
    return None


def _check_schedule(cfg: TrainConfig) -> Problem:
    schedule, pp = cfg.pipeline_schedule, cfg.pipeline_model_parallel_size
    vp, m = cfg.virtual_pipeline_model_parallel_size, cfg.num_microbatches
    found = schedule_spec(schedule)
    if found.chunks is None:
        if pp < found.min_ranks or vp is None or vp < 2:
            return "pipeline_schedule", (
                f"{schedule} needs pipeline_model_parallel_size >= {found.min_ranks} and "
                "virtual_pipeline_model_parallel_size >= 2"
            )
    elif vp is not None:
        virtual = ", ".join(n for n, s in SCHEDULES.items() if s.chunks is None)
        return "virtual_pipeline_model_parallel_size", (
            f"only {virtual} uses virtual pipeline stages; unset it for {schedule}"
        )
    stages = found.model_stages(pp, vp)
    if found.chunks is not None:
        try:
            cfg.stage_layers()
        except DualPipeConfigError as err:
            return _split_key(cfg), str(err)
    elif not cfg.splits_pipeline and cfg.num_layers % stages:
        # Megatron's own interleaved split (its TransformerConfig checks the split keys).
        return "num_layers", (
            f"{schedule} cuts the model into {stages} stages of equal size, but {cfg.num_layers} "
            f"is not divisible by {stages}"
        )
    if pp < found.min_ranks:
        return "pipeline_model_parallel_size", (
            f"{schedule} needs at least {found.min_ranks} pipeline ranks"
        )
    problem = found.problem(pp, m)
    if problem is not None and "micro-batches" in problem:
        return "pipeline_schedule", (
            f"{problem}: raise global_batch_size or lower PP (micro-batches per step = "
            f"global_batch_size / (micro_batch_size x data-parallel size) = "
            f"{cfg.global_batch_size} / ({cfg.micro_batch_size} x {cfg.data_parallel_size}))"
        )
    if problem is not None:
        return "pipeline_schedule", problem
    return None


def _check_schedule_order(cfg: TrainConfig) -> Problem:
    """``optimize_schedule`` and ``schedule_file``: our runtime's schedules only, one at a
    time, and a schedule file that holds a valid schedule of this run's placement."""
    key = "schedule_file" if cfg.schedule_file is not None else "optimize_schedule"
    if cfg.schedule_file is None and not cfg.optimize_schedule:
        return None
    found = schedule_spec(cfg.pipeline_schedule)
    if not found.runs_ours:
        return key, (
            f"reorders the work of the schedules megatron-dualpipe runs "
            f"({', '.join(OUR_SCHEDULES)}), not "
            f"Megatron's {cfg.pipeline_schedule}: set pipeline_schedule to one of them"
        )
    if cfg.schedule_file is not None and cfg.optimize_schedule:
        return "optimize_schedule", (
            "and schedule_file are both set: choose one (optimize_schedule finds an order from "
            "the measured steps; schedule_file runs a saved one)"
        )
    if cfg.schedule_file is not None:
        problem = schedule_file_problem(cfg)
        return None if problem is None else (key, problem)
    if cfg.overlap_grad_reduce:
        return key, (
            "switches the order mid-run, but Megatron's DDP with overlap_grad_reduce learns "
            "the order of gradient hooks in the first step: set overlap_grad_reduce: false, or "
            "save the optimised order (simulate --optimize --save) and run it with schedule_file"
        )
    too_large = optimize_size_problem(
        cfg.pipeline_model_parallel_size, cfg.num_microbatches, found.chunks
    )
    if too_large is not None:
        return key, f"{too_large}: lower global_batch_size, or save an order found elsewhere"
    if cfg.train_iters <= OPTIMIZE_AFTER:
        return key, (
            f"measures the first {OPTIMIZE_AFTER} iterations before it switches: raise "
            f"train_iters above {OPTIMIZE_AFTER}"
        )
    return None


def schedule_file_problem(cfg: TrainConfig) -> str | None:
    """What makes ``cfg.schedule_file`` unusable for this run
    (:func:`~....schedules.saved.saved_schedule_problem`), or None."""
    return saved_schedule_problem(
        cfg.schedule_file,
        cfg.pipeline_schedule,
        cfg.pipeline_model_parallel_size,
        cfg.num_microbatches,
    )


def _split_key(cfg: TrainConfig) -> str:
    """The key a split problem is reported under: the split setting in use, else
    num_layers."""
    if cfg.pipeline_model_parallel_layout is not None:
        return "pipeline_model_parallel_layout"
    if cfg.decoder_first_pipeline_num_layers is not None:
        return "decoder_first_pipeline_num_layers"
    if cfg.decoder_last_pipeline_num_layers is not None:
        return "decoder_last_pipeline_num_layers"
    if cfg.account_for_embedding_in_pipeline_split:
        return "account_for_embedding_in_pipeline_split"
    if cfg.account_for_loss_in_pipeline_split:
        return "account_for_loss_in_pipeline_split"
    return "num_layers"


def _check_overlap(cfg: TrainConfig) -> Problem:
    """Megatron's preconditions of ``overlap_moe_expert_parallel_comm`` (MoE all-to-all
    hidden behind another micro-batch's compute in FB pairs)."""
    if cfg.overlap_moe_expert_parallel_comm:
        problem = overlap_problem(
            cfg.pipeline_schedule,
            expert_parallel=cfg.expert_model_parallel_size,
            dispatcher=cfg.moe_token_dispatcher_type,
            half_precision=cfg.bf16,
            recompute_granularity=cfg.recompute_granularity,
            mtp_num_layers=cfg.mtp_num_layers,
            moe=cfg.is_moe,
        )
        if problem is not None:
            return "overlap_moe_expert_parallel_comm", problem
    return None


def _check_io(cfg: TrainConfig) -> Problem:
    if cfg.run_name is not None and (why := run_name_problem(cfg.run_name)) is not None:
        return "run_name", why
    if cfg.save_interval is not None and cfg.save is None:
        return "save_interval", "needs save (a checkpoint directory)"
    if cfg.log_memory_to_tensorboard and cfg.tensorboard_dir is None:
        return "log_memory_to_tensorboard", "needs tensorboard_dir (where the scalars go)"
    if cfg.eval_interval is not None and cfg.eval_iters == 0:
        return "eval_iters", "must be >= 1 when eval_interval is set"
    if cfg.ckpt_step is not None and cfg.load is None:
        return "ckpt_step", "needs load (the checkpoint directory to load that iteration from)"
    if cfg.override_opt_param_scheduler and cfg.use_checkpoint_opt_param_scheduler:
        return "override_opt_param_scheduler", (
            "and use_checkpoint_opt_param_scheduler are both set: choose one (override: the "
            "config's learning-rate schedule wins; use_checkpoint: the checkpoint's)"
        )
    return _profile_problem(cfg) if cfg.profile else None


def _profile_problem(cfg: TrainConfig) -> Problem:
    """Megatron-LM's profiling keys, as far as this trainer runs them."""
    if not cfg.use_pytorch_profiler:
        return "profile", (
            "needs use_pytorch_profiler: true here (Megatron-LM's other profiler is nsys, "
            "which this trainer does not start)"
        )
    if not 0 <= cfg.profile_step_start < cfg.profile_step_end:
        return "profile_step_end", (
            f"must be above profile_step_start ({cfg.profile_step_start}), and both >= 0"
        )
    if cfg.profile_step_start >= cfg.train_iters:
        return "profile_step_start", (
            f"is at or after train_iters ({cfg.train_iters}): no step would be profiled"
        )
    words = (cfg.profile_ranks or "").replace(",", " ").split()
    if not all(w.isdigit() for w in words):
        return "profile_ranks", f"must be global rank numbers, got {cfg.profile_ranks!r}"
    if cfg.profile_dir is None:
        return "use_pytorch_profiler", (
            "has nowhere to write its traces: set tensorboard_dir or output_dir"
        )
    return None


def _check_recompute(cfg: TrainConfig) -> Problem:
    """Megatron-Core's rules for the recomputation keys, named by key
    (:meth:`~...planner.model_cost.Recompute.problem`), and what this model needs for them."""
    recompute = Recompute(
        cfg.recompute_granularity,
        cfg.recompute_method,
        cfg.recompute_num_layers,
        cfg.recompute_modules,
    )
    problem = recompute.problem()
    if problem is not None or cfg.recompute_modules is None:
        return problem
    modules = recompute.module_set
    if cfg.fp8 is not None and cfg.fp8_recipe == "delayed" and modules & {"moe_act", "layernorm"}:
        return "recompute_modules", (
            "moe_act and layernorm recomputation with fp8 need a recipe other than "
            "fp8_recipe: delayed (Megatron-Core's rule): set fp8_recipe: tensorwise, blockwise "
            "or mxfp8, or recompute other modules"
        )
    if "mla_up_proj" in modules and not cfg.multi_latent_attention:
        return "recompute_modules", "mla_up_proj needs multi_latent_attention: true"
    if modules & {"moe", "moe_act", "shared_experts"} and not cfg.is_moe:
        return "recompute_modules", "moe, moe_act and shared_experts need a MoE model (num_experts)"
    if "mlp" in modules and cfg.add_bias_linear:
        return "recompute_modules", (
            "mlp with add_bias_linear: true never ends its backward in Megatron-Core (the "
            "recomputed MLP hands its bias parameter out of tensor_parallel.checkpoint, whose "
            "backward then calls itself until the stack overflows; measured with 0.16.1): set "
            "add_bias_linear: false (--disable-bias-linear), or recompute core_attn only"
        )
    return None


def _check_cuda_graphs(cfg: TrainConfig) -> Problem:
    """The CUDA-graph keys: one name of the graphed parts, the implementation the schedule
    can graph (:func:`~...schedules.cuda_graphs.cuda_graph_problem`), and the one this
    loop runs (local: the layers capture themselves; full_iteration under our schedules:
    the whole step; transformer_engine: TE's per-layer graphs, captured by this loop as by
    Megatron-LM's, under our schedules in their order: :mod:`..layer_graphs`)."""
    if cfg.cuda_graph_modules is not None and cfg.cuda_graph_scope is not None:
        return "cuda_graph_scope", (
            "is megatron-core 0.16/0.17's name of cuda_graph_modules, which is set too: keep one"
        )
    key = "cuda_graph_modules" if cfg.cuda_graph_modules is not None else "cuda_graph_scope"
    modules = cfg.cuda_graph_module_names
    if "full_iteration" in modules:
        return key, (
            "full_iteration is an implementation in megatron-core 0.18's names, used here for "
            "every release: set cuda_graph_impl: full_iteration and leave this unset"
        )
    problem = cuda_graph_problem(
        cfg.pipeline_schedule,
        cfg.cuda_graph_impl,
        modules,
        shared_expert_in_router_graph=cfg.moe_shared_expert_intermediate_size is not None,
    )
    if problem is not None:  # "<key> <what is wrong>": the key leads the message
        named, _, message = problem.partition(" ")
        return ("cuda_graph_impl" if named == "cuda_graph_impl" else key), message
    te_graphs = cfg.cuda_graph_impl == "transformer_engine"
    if te_graphs and cfg.transformer_impl == "local" and (not modules or "attn" in modules):
        return "cuda_graph_impl", (
            f"transformer_engine graphing {' '.join(modules) or 'the whole layer'} with "
            "transformer_impl: local replays attention without its causal mask: Megatron's "
            "replay hands the graph an all-False attention mask where the model passes none, "
            "and Megatron's local attention applies a mask it is given in place of the causal "
            "one (the replayed steps' losses left the eager run's, measured on CPU): graph "
            "other parts, or use transformer_impl: transformer_engine"
        )
    ours = SCHEDULES[cfg.pipeline_schedule].runs_ours
    if cfg.cuda_graph_impl in ("full_iteration", "transformer_engine") and ours:
        return _check_graphs_of_ours(cfg)
    if cfg.cuda_graph_impl == "full_iteration":
        return "cuda_graph_impl", (
            f"full_iteration graphs of {cfg.pipeline_schedule} are captured by Megatron-LM's "
            "training loop (FullCudaGraphWrapper), which train does not run: use "
            "cuda_graph_impl: local or transformer_engine, full_iteration under zb1p or "
            "dualpipev, or Megatron-LM's pretrain_gpt.py with the bundled patch"
        )
    return None


def _check_graphs_of_ours(cfg: TrainConfig) -> Problem:
    """Whole-step (full_iteration) or TE per-layer (transformer_engine) graphs under our
    schedules: both are captured in one step's order, which the schedule optimiser would
    change after it measures; the whole step is captured after at least one warm-up step,
    and TE's layers in the schedule's order, which Megatron's combined 1F1B order under
    ``overlap_moe_expert_parallel_comm`` would replace."""
    impl = cfg.cuda_graph_impl
    if cfg.optimize_schedule:  # it measures a step's timeline, then reorders the step
        return "optimize_schedule", (
            "measures a step's timeline, and a step under cuda_graph_impl: full_iteration "
            "records none: set one of them"
            if impl == "full_iteration"
            else "reorders the step after it measures one, and TE's graphs under "
            "cuda_graph_impl: transformer_engine replay in the order they were captured in: "
            "set one of them"
        )
    if impl == "full_iteration" and cfg.cuda_graph_warmup_steps < 1:
        return "cuda_graph_warmup_steps", (  # the first step builds executor and groups
            "0 under cuda_graph_impl: full_iteration would capture the first step, which "
            "builds the executor and its process group: set it to 1 or more"
        )
    problem = ep_overlap_graph_problem(
        cfg.pipeline_schedule, impl, cfg.overlap_moe_expert_parallel_comm
    )
    return None if problem is None else ("overlap_moe_expert_parallel_comm", problem)
