"""The training configuration: a YAML file (plus ``--set key=value`` overrides) read into a
typed, validated :class:`TrainConfig`.

Keys mirror Megatron-LM's command-line flags in snake_case (``--num-layers`` is
``num_layers``). Loading never imports torch or megatron. Every problem is one
:class:`ConfigError` sentence of the form ``<source>: <key>: <what is wrong and what to
do>``: unknown keys, wrong types, values out of range, and the pipeline schedule's own
constraints (checked with the schedule generators, as at run time).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ...errors import DualPipeError
from ...schedules.config_values import override_origins
from ...schedules.cuda_graphs import CUDA_GRAPH_IMPLS, cuda_graph_problem
from ...schedules.ir import Schedule, ScheduleError
from ...schedules.limits import (
    MAX_TRAIN_SIZE,
    optimize_size_problem,
    schedule_size,
    train_size_problem,
)
from ...schedules.model_cost import Recompute, parse_moe_layer_freq
from ...schedules.registry import OUR_SCHEDULES, SCHEDULES
from ...schedules.validate import check_weight_grads_in_b_order, validate
from ..checks import DualPipeConfigError, overlap_problem, schedule_spec, stage_layers
from .run_name import run_name, run_name_problem

__all__ = [
    "OPTIMIZE_AFTER",
    "ConfigError",
    "ConfigKey",
    "TrainConfig",
    "config_from_values",
    "config_keys",
    "load_config",
    "parse_overrides",
    "read_yaml_values",
    "ConfigSource",
    "blame",
    "config_source",
]


#: Iterations ``optimize_schedule`` runs (and measures) the hand-made order before it
#: switches: the first warms up, the second is measured.
OPTIMIZE_AFTER = 2


class ConfigError(DualPipeError, ValueError):
    """A configuration that cannot run; the message names the source, the key and the fix."""


def _key(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    flags: tuple[str, ...] = (),
    megatron_lm: bool = True,
) -> Any:
    """A config field with its one-line documentation and its command-line spellings:
    ``flags`` where Megatron-LM spells the key otherwise (the first is shown; default
    ``--`` + the key with dashes); ``megatron_lm=False`` for megatron-dualpipe's own keys."""
    metadata = {"doc": doc, "flags": flags, "megatron_lm": megatron_lm}
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Fields without a default are required; the others default to
    Megatron-LM's defaults except: dropout 0 (Megatron-LM: 0.1; with dropout the masks
    depend on the order micro-batches run in, so losses would differ between schedules),
    ``untie_embeddings_and_output_weights`` true (Megatron-LM: false, tied), no evaluation
    unless ``eval_interval`` is set, and ``world_size`` one model replica (TP x PP).
    The pipeline split keys read over the schedule's model stages in pipeline order
    (dualpipev: the 2 x PP stages of the V; see docs/megatron.md).
    Under torchrun or srun the launcher's world size replaces ``world_size``."""

    # Model.
    num_layers: int = _key(doc="transformer layers in the decoder")
    hidden_size: int = _key(doc="width of the hidden states")
    num_attention_heads: int = _key(doc="attention heads per layer")
    seq_length: int = _key(doc="tokens per sample")
    # Batches and steps.
    micro_batch_size: int = _key(doc="samples per micro-batch")
    global_batch_size: int = _key(doc="samples per step over all data-parallel ranks")
    train_iters: int = _key(doc="training steps to run")
    lr: float = _key(doc="peak learning rate")
    # Parallelism.
    pipeline_schedule: str = _key(
        "1f1b",
        doc="pipeline schedule (the bundled patch adds this flag to Megatron-LM)",
        megatron_lm=False,
    )
    pipeline_model_parallel_size: int = _key(1, doc="pipeline-parallel ranks (PP)")
    virtual_pipeline_model_parallel_size: int | None = _key(
        None,
        doc="model chunks per pipeline rank for interleaved-1f1b (the second flag is the "
        "setting's name in Megatron-LM)",
        flags=("--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size"),
    )
    tensor_model_parallel_size: int = _key(1, doc="tensor-parallel ranks (TP)")
    expert_model_parallel_size: int = _key(1, doc="expert-parallel ranks (EP) of MoE layers")
    sequence_parallel: bool = _key(False, doc="split the sequence over tensor-parallel ranks")
    world_size: int | None = _key(
        None,
        doc="ranks to fork without a launcher (default: TP x PP; torchrun or srun set their own)",
        megatron_lm=False,
    )
    optimize_schedule: bool = _key(
        False,
        doc="run the hand-made order for the first iterations with the timeline recorded, "
        "then the order the schedule optimiser finds for the measured costs",
        megatron_lm=False,
    )
    schedule_file: str | None = _key(
        None,
        doc="a saved schedule (simulate --save's text form) to run in place of the generated one",
        megatron_lm=False,
    )
    transformer_impl: str | None = _key(
        None,
        doc="transformer_engine (TE layers, flash attention, fused kernels, grouped GEMM "
        "experts) or local (Megatron-Core's own modules, CPU); default: transformer_engine "
        "where CUDA and Transformer Engine are present, else local",
    )
    # CUDA graphs (Megatron-Core's keys; docs/megatron.md "CUDA graphs").
    cuda_graph_impl: str = _key(
        "none",
        doc="CUDA graphs: none; local (each layer records and replays its graphs: under "
        "zb1p, dualpipe and dualpipev only parts that defer no weight gradient); "
        "full_iteration (the whole forward-backward step captured once, under zb1p and "
        "dualpipev); transformer_engine is Megatron-LM's training loop's (refused here); "
        "needs CUDA",
    )
    cuda_graph_modules: str | None = _key(
        None,
        doc="the parts of each layer a graph covers: attn mlp moe moe_router moe_preprocess "
        "mamba (unset: the whole layer; megatron-core 0.18's name, Megatron-LM core_v0.18.0's "
        "flag)",
    )
    cuda_graph_scope: str | None = _key(
        None, doc="cuda_graph_modules under its megatron-core 0.16/0.17 name (set one of them)"
    )
    cuda_graph_warmup_steps: int = _key(3, doc="steps run eagerly before the graphs are captured")
    # Model details.
    vocab_size: int | None = _key(
        None,
        doc="tokens in the vocabulary: required for the synthetic data and NullTokenizer; "
        "the other tokenizers give their own",
    )
    num_query_groups: int | None = _key(
        None, doc="key/value head groups for grouped-query attention (default: one per head)"
    )
    ffn_hidden_size: int | None = _key(None, doc="MLP width (default: 4 x hidden_size)")
    max_position_embeddings: int | None = _key(
        None, doc="longest sequence the position embeddings cover (default: seq_length)"
    )
    position_embedding_type: str = _key("learned_absolute", doc="how positions are encoded")
    normalization: str = _key("LayerNorm", doc="the normalization layer")
    swiglu: bool = _key(False, doc="SwiGLU activation in the MLP")
    add_bias_linear: bool = _key(
        True, doc="bias terms in the linear layers", flags=("--disable-bias-linear",)
    )
    hidden_dropout: float = _key(0.0, doc="dropout after attention and MLP")
    attention_dropout: float = _key(0.0, doc="dropout on the attention probabilities")
    init_method_std: float = _key(0.02, doc="standard deviation of the weight initialisation")
    # Mixture of experts.
    num_experts: int | None = _key(None, doc="routed experts per MoE layer (unset: dense)")
    moe_router_topk: int = _key(2, doc="experts each token is routed to")
    moe_ffn_hidden_size: int | None = _key(
        None, doc="width of each expert's MLP (default: ffn_hidden_size)"
    )
    moe_shared_expert_intermediate_size: int | None = _key(
        None, doc="width of the shared expert (unset: none)"
    )
    moe_token_dispatcher_type: str = _key("allgather", doc="how tokens reach their experts")
    moe_router_load_balancing_type: str = _key("aux_loss", doc="the router's load-balancing loss")
    moe_aux_loss_coeff: float = _key(0.0, doc="weight of the load-balancing loss")
    moe_router_dtype: str | None = _key(None, doc="precision of the router's computation")
    overlap_moe_expert_parallel_comm: bool = _key(
        False, doc="hide the MoE all-to-all behind another micro-batch's compute"
    )
    moe_layer_freq: str | None = _key(
        None, doc="which layers are MoE: N (every Nth) or a 0/1 list such as [0]*3+[1]*58"
    )
    moe_router_score_function: str = _key("softmax", doc="the router's score function")
    moe_router_enable_expert_bias: bool = _key(
        False, doc="per-expert bias for aux-loss-free load balancing (needs sigmoid)"
    )
    moe_router_bias_update_rate: float = _key(1e-3, doc="step of the expert bias update")
    moe_router_topk_scaling_factor: float | None = _key(
        None, doc="factor on the top-k routing weights"
    )
    # Pipeline split, over the schedule's model stages (Megatron-LM's flags).
    decoder_first_pipeline_num_layers: int | None = _key(
        None, doc="decoder layers of the first pipeline stage"
    )
    decoder_last_pipeline_num_layers: int | None = _key(
        None, doc="decoder layers of the last pipeline stage"
    )
    account_for_embedding_in_pipeline_split: bool = _key(
        False, doc="count the embedding as a layer when splitting the pipeline"
    )
    account_for_loss_in_pipeline_split: bool = _key(
        False, doc="count the output layer and loss as a layer when splitting the pipeline"
    )
    pipeline_model_parallel_layout: str | None = _key(
        None, doc='every stage\'s layers, e.g. "Et|(tt|)*30,mL"'
    )
    # Embeddings, multi-token prediction, multi-latent attention.
    untie_embeddings_and_output_weights: bool = _key(
        True, doc="separate input embedding and output weights"
    )
    mtp_num_layers: int | None = _key(None, doc="multi-token prediction layers (unset: none)")
    mtp_loss_scaling_factor: float = _key(0.1, doc="weight of the multi-token prediction loss")
    multi_latent_attention: bool = _key(False, doc="multi-latent attention (MLA)")
    q_lora_rank: int | None = _key(None, doc="MLA: rank of the query compression (unset: none)")
    kv_lora_rank: int = _key(32, doc="MLA: rank of the key/value compression")
    qk_head_dim: int = _key(128, doc="MLA: query/key head size without the position part")
    qk_pos_emb_head_dim: int = _key(64, doc="MLA: query/key head size of the position part")
    v_head_dim: int = _key(128, doc="MLA: value head size")
    rope_type: str | None = _key(None, doc="MLA: rotary embedding variant")
    qk_layernorm: bool = _key(
        False, doc="normalise queries and keys (MLA: its two low-rank norms, as in DeepSeek-V3)"
    )
    # Optimizer and learning-rate schedule.
    optimizer: str = _key("adam", doc="the optimizer")
    min_lr: float = _key(0.0, doc="learning rate at the end of the decay")
    lr_warmup_iters: int = _key(0, doc="steps of linear warm-up")
    lr_decay_iters: int | None = _key(None, doc="steps of decay (default: train_iters)")
    lr_decay_style: str = _key("linear", doc="shape of the learning-rate decay")
    weight_decay: float = _key(0.01, doc="weight decay coefficient")
    adam_beta1: float = _key(0.9, doc="Adam's first-moment decay")
    adam_beta2: float = _key(0.999, doc="Adam's second-moment decay")
    adam_eps: float = _key(1e-8, doc="Adam's epsilon")
    sgd_momentum: float = _key(0.9, doc="SGD's momentum")
    clip_grad: float = _key(1.0, doc="clip the gradients' global norm to this (0: no clipping)")
    bf16: bool = _key(False, doc="bfloat16 compute with fp32 main weights")
    recompute_granularity: str | None = _key(
        None, doc="activation recomputation: full layers or selected submodules"
    )
    use_distributed_optimizer: bool = _key(
        False, doc="shard the optimizer state over data-parallel ranks"
    )
    overlap_grad_reduce: bool = _key(
        False, doc="overlap the data-parallel gradient reduction with the backward"
    )
    recompute_method: str | None = _key(
        None, doc="full recomputation: which layers (uniform: every group; block: the first)"
    )
    recompute_num_layers: int | None = _key(
        None, doc="full recomputation: layers per recomputed group (uniform) or recomputed (block)"
    )
    recompute_modules: str | None = _key(
        None,
        doc="selective recomputation: the submodules recomputed, e.g. core_attn mlp (default "
        "core_attn)",
        flags=("--recompute-modules",),
    )
    fp8: str | None = _key(
        None,
        doc="FP8 training through Transformer Engine: e4m3, or hybrid (e5m2 gradients); "
        "unset: none",
        flags=("--fp8-format",),
    )
    fp8_recipe: str = _key("delayed", doc="FP8 scaling: delayed, tensorwise, blockwise or mxfp8")
    seed: int = _key(1234, doc="random seed of the weights and the data")
    # Data and tokenizer (Megatron-LM's keys; without a data key: synthetic tokens).
    data_path: str | None = _key(
        None,
        doc="indexed datasets (.bin/.idx prefixes), weighted for a blend: [W1] PREFIX1 [W2] "
        "PREFIX2 ...; split into train/valid/test by split",
    )
    split: str = _key("969,30,1", doc="train,valid,test weights of data_path's documents")
    train_data_path: str | None = _key(None, doc="indexed datasets of the training split alone")
    valid_data_path: str | None = _key(None, doc="indexed datasets of the validation split alone")
    test_data_path: str | None = _key(None, doc="indexed datasets of the test split alone")
    mock_data: bool = _key(False, doc="Megatron-Core's mock GPT dataset instead of data files")
    data_cache_path: str | None = _key(
        None, doc="folder for the datasets' index caches (default: beside the data)"
    )
    reset_position_ids: bool = _key(False, doc="restart position ids after each end of document")
    reset_attention_mask: bool = _key(
        False, doc="attend only within a document (a mask per sample, read on every rank)"
    )
    eod_mask_loss: bool = _key(False, doc="no loss on end-of-document tokens")
    tokenizer_type: str | None = _key(
        None, doc="Megatron-Core's tokenizer for data_path / mock_data"
    )
    tokenizer_model: str | None = _key(
        None, doc="HuggingFaceTokenizer: a local directory holding tokenizer.json"
    )
    vocab_file: str | None = _key(None, doc="GPT2BPETokenizer: the vocabulary (vocab.json)")
    merge_file: str | None = _key(None, doc="GPT2BPETokenizer: the BPE merges (merges.txt)")
    make_vocab_size_divisible_by: int = _key(
        128, doc="pad the tokenizer's vocabulary to a multiple of this x TP"
    )
    # Evaluation, logging, checkpoints, outputs.
    eval_interval: int | None = _key(None, doc="steps between evaluations (unset: none)")
    eval_iters: int = _key(0, doc="batches per evaluation")
    log_interval: int = _key(100, doc="steps between iteration lines")
    log_throughput: bool = _key(
        False,
        doc="add the throughput per GPU (TFLOP/s, by Megatron-LM's FLOP count) to each "
        "iteration line, and to TensorBoard",
    )
    log_memory_to_tensorboard: bool = _key(
        False,
        doc="write Megatron-LM's CUDA memory scalars (mem-reserved-bytes, ...) to "
        "TensorBoard every tensorboard_log_interval (needs tensorboard_dir; none on CPU)",
    )
    tensorboard_dir: str | None = _key(
        None,
        doc="write TensorBoard scalars under this directory, each run in its folder run_name "
        "(needs tensorboard)",
    )
    tensorboard_log_interval: int = _key(
        1,
        doc="steps between TensorBoard's scalars of one step (loss, learning rate, grad "
        "norm, ...); the timings go every log_interval",
    )
    profile: bool = _key(
        False,
        doc="profile the steps after profile_step_start up to profile_step_end (Megatron-LM's "
        "--profile; here with use_pytorch_profiler, the profiler this trainer runs)",
    )
    profile_step_start: int = _key(10, doc="with profile: the iteration profiling starts at")
    profile_step_end: int = _key(12, doc="with profile: the iteration profiling stops at")
    profile_ranks: str | None = _key(
        None, doc="with profile: the global ranks to profile, a list (unset: every rank)"
    )
    use_pytorch_profiler: bool = _key(
        False,
        doc="with profile: torch.profiler, one Chrome trace per profiled rank "
        "(rank-N.json.gz, a span per pipeline action, read by simulate --profile) in "
        "tensorboard_dir/../torch_profile as Megatron-LM writes them, else the run's folder",
    )
    save: str | None = _key(None, doc="checkpoint directory to save to")
    save_interval: int | None = _key(
        None, doc="steps between checkpoints (the last step is saved too)"
    )
    exit_interval: int | None = _key(
        None, doc="stop at the next step that is a multiple of this (saving if save is set)"
    )
    load: str | None = _key(None, doc="checkpoint directory to resume from")
    output_dir: str | None = _key(
        "runs",
        doc="folder the runs' outputs (the timeline picture) go under, each run in its own "
        "folder, run_name (null: none)",
        megatron_lm=False,
    )
    run_name: str | None = _key(
        None,
        doc="this run's folder under output_dir (default: the config's name, the schedule and "
        "the settings given on the command line that change what is trained; null: "
        "output_dir itself)",
        megatron_lm=False,
    )
    distributed_timeout_minutes: float = _key(
        10.0, doc="minutes a collective may wait before the run fails"
    )
    # Faults and resuming (Megatron-LM's keys and defaults).
    check_for_nan_in_loss_and_grad: bool = _key(
        True,
        doc="stop at the first NaN or Inf in the loss or gradients",
        flags=("--no-check-for-nan-in-loss-and-grad",),
    )
    ckpt_step: int | None = _key(None, doc="iteration to load (default: the latest)")
    override_opt_param_scheduler: bool = _key(
        False,
        doc="on resume, take the learning-rate schedule from the config",
        flags=("--override-opt_param-scheduler", "--override-opt-param-scheduler"),
    )
    use_checkpoint_opt_param_scheduler: bool = _key(
        False,
        doc="on resume, take the learning-rate schedule from the checkpoint",
        flags=("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"),
    )

    @property
    def data_parallel_size(self) -> int:
        """Ranks over ``tensor x pipeline`` model replicas."""
        return self.launch_world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )

    @property
    def tensorboard_run_dir(self) -> str | None:
        """Where this run's TensorBoard events go: ``tensorboard_dir/run_name``, so that
        each run is a run of its own in TensorBoard (``tensorboard --logdir
        tensorboard_dir``); ``tensorboard_dir`` itself with ``run_name: null``."""
        if self.tensorboard_dir is None or self.run_name is None:
            return self.tensorboard_dir
        return str(Path(self.tensorboard_dir) / self.run_name)

    @property
    def profile_dir(self) -> str | None:
        """Where ``use_pytorch_profiler`` traces go: Megatron-LM's
        ``tensorboard_dir/../torch_profile``, else ``run_dir/torch_profile``."""
        if self.tensorboard_dir is not None:
            return str(Path(self.tensorboard_dir).parent / "torch_profile")
        base = self.run_dir
        return None if base is None else str(Path(base) / "torch_profile")

    def profiled_ranks(self) -> tuple[int, ...] | None:
        """``profile_ranks`` as numbers (None: every rank)."""
        if not self.profile_ranks:
            return None
        return tuple(int(word) for word in self.profile_ranks.replace(",", " ").split())

    @property
    def run_dir(self) -> str | None:
        """Where this run's outputs go: ``output_dir/run_name`` (None without output_dir)."""
        if self.output_dir is None or self.run_name is None:
            return self.output_dir
        return str(Path(self.output_dir) / self.run_name)

    @property
    def launch_world_size(self) -> int:
        """``world_size``, or one model replica (TP x PP) when unset."""
        if self.world_size is not None:
            return self.world_size
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on each data-parallel rank."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def uses_data_files(self) -> bool:
        """Whether the tokens come from indexed datasets (data_path or the per-split paths)."""
        return any(
            getattr(self, key) is not None
            for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path")
        )

    @property
    def cuda_graph_module_names(self) -> tuple[str, ...]:
        """The graphed parts (``cuda_graph_modules``, else ``cuda_graph_scope``) as a tuple;
        empty for the whole layer (Megatron's old spelling ``full`` included)."""
        words = (self.cuda_graph_modules or self.cuda_graph_scope or "").split()
        return tuple(w for w in words if w != "full")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def moe_layer_pattern(self) -> int | list[int]:
        """``moe_layer_freq`` as Megatron-Core takes it: an int N (one MoE layer every N) or
        one 0 (dense) / 1 (MoE) per layer; 1 (every layer MoE) when unset."""
        if self.moe_layer_freq is None:
            return 1
        return parse_moe_layer_freq(self.moe_layer_freq)

    def stage_layers(self) -> tuple[int, ...]:
        """Decoder layers of each of the schedule's model stages, in pipeline order
        (:func:`~..checks.stage_layers`); DualPipeConfigError where they do not split."""
        return stage_layers(
            self.pipeline_schedule,
            self.pipeline_model_parallel_size,
            self.num_layers,
            first=self.decoder_first_pipeline_num_layers,
            last=self.decoder_last_pipeline_num_layers,
            account_for_embedding=self.account_for_embedding_in_pipeline_split,
            account_for_loss=self.account_for_loss_in_pipeline_split,
            layout=self.pipeline_model_parallel_layout,
            mtp_num_layers=self.mtp_num_layers,
        )

    @property
    def splits_pipeline(self) -> bool:
        """Whether a split key (first/last counts, accounting, layout) is set."""
        return (
            self.decoder_first_pipeline_num_layers is not None
            or self.decoder_last_pipeline_num_layers is not None
            or self.account_for_embedding_in_pipeline_split
            or self.account_for_loss_in_pipeline_split
            or self.pipeline_model_parallel_layout is not None
        )

    @property
    def model_chunks(self) -> int:
        """Model chunks each pipeline rank holds."""
        return schedule_spec(self.pipeline_schedule).chunks_per_rank(
            self.virtual_pipeline_model_parallel_size
        )

    def with_world_size(self, world_size: int, source: str) -> TrainConfig:
        """This config for a launcher-given world size, validated again."""
        if world_size == self.launch_world_size:
            return self
        return _validated(dataclasses.replace(self, world_size=world_size), source)


# --------------------------------------------------------------------------------------
# Reading.

_CHOICES: dict[str, tuple[str | None, ...]] = {
    "pipeline_schedule": tuple(SCHEDULES),
    "cuda_graph_impl": CUDA_GRAPH_IMPLS,
    "transformer_impl": (None, "transformer_engine", "local"),
    "position_embedding_type": ("learned_absolute", "rope"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "moe_token_dispatcher_type": ("alltoall", "allgather"),
    "moe_router_load_balancing_type": ("none", "aux_loss", "seq_aux_loss"),
    "moe_router_dtype": (None, "fp32", "fp64"),
    "moe_router_score_function": ("softmax", "sigmoid"),
    "rope_type": (None, "rope", "yarn"),
    "recompute_granularity": (None, "full", "selective"),
    "recompute_method": (None, "uniform", "block"),
    "tokenizer_type": (None, "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer"),
    "fp8": (None, "e4m3", "hybrid"),
    "fp8_recipe": ("delayed", "tensorwise", "blockwise", "mxfp8"),
    "optimizer": ("adam", "sgd"),
    "lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root"),
}
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
#: String keys whose Megatron-LM flag also takes an integer.
_INT_OR_STRING = ("moe_layer_freq",)
#: String keys whose Megatron-LM flag takes several words (a YAML list, joined by spaces).
WORD_LISTS = (
    "data_path",
    "train_data_path",
    "valid_data_path",
    "test_data_path",
    "recompute_modules",
    "profile_ranks",
    "cuda_graph_modules",
    "cuda_graph_scope",
)
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_TYPES = typing.get_type_hints(TrainConfig)


@dataclass(frozen=True)
class ConfigKey:
    """One key of :class:`TrainConfig` as a command line offers it."""

    name: str
    doc: str
    #: Its flags, the first shown in help: Megatron-LM's spellings where ``megatron_lm``.
    flags: tuple[str, ...]
    megatron_lm: bool
    #: ``int``, ``float``, ``bool`` or ``str`` (None allowed where the default is None).
    type: type
    required: bool
    default: Any
    choices: tuple[str, ...] | None


def config_keys() -> tuple[ConfigKey, ...]:
    """Every key of :class:`TrainConfig` in definition order, with its documentation and
    flags (from the field definitions, so that command lines cannot drift from them)."""
    return tuple(
        ConfigKey(
            name=f.name,
            doc=f.metadata["doc"],
            flags=f.metadata["flags"] or ("--" + f.name.replace("_", "-"),),
            megatron_lm=f.metadata["megatron_lm"],
            type=_base(_TYPES[f.name])[0],
            required=_required(f),
            default=f.default,
            choices=tuple(c for c in _CHOICES[f.name] if c is not None)
            if f.name in _CHOICES
            else None,
        )
        for f in _FIELDS.values()
    )


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> TrainConfig:
    """Read, override and validate a YAML config; raises :class:`ConfigError`.

    ``overrides`` are ``key=value`` strings (the CLI's ``--set``); their values are
    converted to the key's type. ``run_name`` defaults to the file's stem, the schedule and
    the overrides (:func:`~.run_name.run_name`).
    """
    values = read_yaml_values(path)
    overrides = list(overrides)
    overridden = parse_overrides(overrides)
    values.update(overridden)
    source, origins = override_origins(path, overrides)
    return config_from_values(values, source, Path(path).stem, origins)


def read_yaml_values(path: str | Path) -> dict[str, Any]:
    """A YAML config's keys and values, each checked against its key's type; raises
    :class:`ConfigError` naming the file (unreadable, not YAML, unknown key, wrong type)."""
    source = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"{source}: cannot read the config: {err.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else None
        raise ConfigError(f"{source}: not valid YAML: {where or _one_line(err)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys to values at the top level")
    return {str(k): _coerce(source, str(k), v) for k, v in raw.items()}


def config_from_values(
    values: dict[str, Any],
    source: str,
    stem: str,
    origins: Mapping[str, str] | None = None,
) -> TrainConfig:
    """Validate ``values`` (known keys, typed as :func:`parse_overrides` types them) into a
    config. The default ``run_name`` is :func:`~.run_name.run_name` of ``stem`` (the
    config's name), the schedule and the keys in ``origins`` (those given on the command
    line), so that runs which differ keep their own outputs. Raises :class:`ConfigError`
    naming ``source``, or for a key in ``origins`` where its value came from (``--set``, a
    flag)."""
    schedule = values.get("pipeline_schedule", _FIELDS["pipeline_schedule"].default)
    given = {key: values[key] for key in origins or {} if key in values}
    values = {"run_name": run_name(stem, schedule, given), **values}
    missing = [n for n, f in _FIELDS.items() if _required(f) and n not in values]
    if missing:
        raise ConfigError(f"{source}: {missing[0]}: required key missing")
    return _validated(TrainConfig(**values), source, origins or {})


def parse_overrides(overrides: Iterable[str], source: str = "--set") -> dict[str, Any]:
    """``["key=value", ...]`` to typed values; raises :class:`ConfigError` naming
    ``source`` (where the values came from: ``--set``, a command-line flag)."""
    values: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"{source} {item}: write key=value")
        values[key] = _from_text(source, key, text.strip())
    return values


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _check_key(source: str, key: str) -> type:
    if key not in _FIELDS:
        close = difflib.get_close_matches(key, _FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{source}: {key}: unknown key{hint}")
    return _TYPES[key]


def _base(tp: Any) -> tuple[type, bool]:
    """``int | None`` -> (int, True); ``int`` -> (int, False)."""
    if isinstance(tp, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _coerce(source: str, key: str, value: Any) -> Any:
    """A YAML value checked against the key's type (ints accepted as floats; float
    literals YAML 1.1 reads as strings, such as ``1e-4``, accepted as floats)."""
    base, optional = _base(_check_key(source, key))
    if value is None and optional:
        return None
    if base is bool and isinstance(value, bool):
        return value
    if base is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if base is float and not isinstance(value, bool):
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str) and _FLOAT.match(value.strip()):
            return float(value)
    if base is str and isinstance(value, str):
        return value
    if key in WORD_LISTS and isinstance(value, list) and value:
        return " ".join(str(v) for v in value)
    if key in _INT_OR_STRING and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    nullable = " or null" if optional else ""
    raise ConfigError(
        f"{source}: {key}: expected {_NAMES[base]}{nullable}, got {value!r} "
        f"({type(value).__name__})"
    )


def _from_text(source: str, key: str, text: str) -> Any:
    """An override's text converted to the key's type."""
    base, optional = _base(_check_key(source, key))
    if optional and text.lower() in ("null", "none", "~", ""):
        return None
    try:
        if base is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError
        if base is int:
            return int(text)
        if base is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{source}: {key}: expected {_NAMES[base]}, got {text!r}") from None
    return text


# --------------------------------------------------------------------------------------
# Validation.


def _validated(
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
        _check_data,
        _check_tokenizer,
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


Problem = tuple[str, str] | None
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
    for key, choices in _CHOICES.items():
        if getattr(cfg, key) not in choices:
            names = ", ".join(c for c in choices if c is not None)
            return key, f"{getattr(cfg, key)!r} is not one of {names}"
    for name, tp in _TYPES.items():
        value = getattr(cfg, name)
        base, _ = _base(tp)
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
    """What makes ``cfg.schedule_file`` unusable for this run (unreadable, not a valid
    schedule, another placement), or None."""
    path = cfg.schedule_file
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        return f"cannot read {path}: {err.strerror}"
    try:
        schedule = Schedule.from_text(text)
        validate(schedule)  # with the dry run, as simulate --load: a deadlock is found here
        check_weight_grads_in_b_order(schedule)
    except ScheduleError as err:
        return f"{path} is not a valid schedule ({err}): write it with simulate --save"
    pp, m = cfg.pipeline_model_parallel_size, cfg.num_microbatches
    expected = schedule_spec(cfg.pipeline_schedule).generate(pp, m).placement
    p = schedule.placement
    if p != expected:
        return (
            f"{path} holds a schedule of the {p.kind} placement for PP={p.num_ranks} with "
            f"{p.num_stages} stages and {p.num_microbatches} micro-batches, but this "
            f"{cfg.pipeline_schedule} run has the {expected.kind} placement for PP={pp} with "
            f"{expected.num_stages} stages and {m} micro-batches: save a schedule for this "
            "run (simulate --schedule "
            f"{cfg.pipeline_schedule} --pp {pp} --microbatches {m} --optimize --save FILE)"
        )
    return None


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
    (:meth:`~...schedules.model_cost.Recompute.problem`), and what this model needs for them."""
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
    the whole step; transformer_engine is captured by Megatron-LM's training loop, under
    our schedules in their order: :mod:`...megatron.te_graphs`)."""
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
    ours = SCHEDULES[cfg.pipeline_schedule].runs_ours
    if cfg.cuda_graph_impl == "full_iteration" and ours:
        if cfg.optimize_schedule:  # it measures a step's timeline, which a graph has none of
            return "optimize_schedule", (
                "measures a step's timeline, and a step under cuda_graph_impl: "
                "full_iteration records none: set one of them"
            )
        if cfg.cuda_graph_warmup_steps < 1:  # the first step builds executor and groups
            return "cuda_graph_warmup_steps", (
                "0 under cuda_graph_impl: full_iteration would capture the first step, which "
                "builds the executor and its process group: set it to 1 or more"
            )
        return None
    if cfg.cuda_graph_impl in ("transformer_engine", "full_iteration"):
        helper = (
            "TECudaGraphHelper" if cfg.cuda_graph_impl == "transformer_engine" else
            "FullCudaGraphWrapper"
        )
        in_order = (
            f" (in {cfg.pipeline_schedule}'s order under the bundled patch)"
            if ours and cfg.cuda_graph_impl == "transformer_engine"
            else ""
        )
        return "cuda_graph_impl", (
            f"{cfg.cuda_graph_impl} graphs of {cfg.pipeline_schedule} are captured by "
            f"Megatron-LM's training loop ({helper}{in_order}), which train does not run: use "
            "cuda_graph_impl: local, full_iteration under zb1p or dualpipev, or Megatron-LM's "
            "pretrain_gpt.py with the bundled patch"
        )
    return None


#: The keys that name indexed datasets.
DATA_PATH_KEYS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def split_weights(split: str) -> list[float] | None:
    """``split`` (``969,30,1``; commas or slashes) as three weights, the missing ones 0, as
    Megatron-Core reads it; None when it is not 1 to 3 numbers >= 0 with a positive sum
    (:func:`split_problem` says which)."""
    return None if split_problem(split) else _split_numbers(split)


def _split_numbers(split: str) -> list[float] | None:
    """``split``'s 1 to 3 numbers (of any sign) padded with 0 to three, or None."""
    words = [w for w in re.split(r"[,/ ]+", split.strip()) if w]
    if not 1 <= len(words) <= 3 or not all(_FLOAT.match(w) for w in words):
        return None
    return [float(w) for w in words] + [0.0] * (3 - len(words))


def split_problem(split: str) -> str | None:
    """What is wrong with ``split`` as a clause with what to change, or None. Megatron-Core
    reads only its digits (``-10,110,0`` as 10,110,0), so a sign is refused here."""
    weights = _split_numbers(split)
    if weights is None:
        return f"{split!r} is not up to three weights such as 969,30,1 (train, valid, test)"
    if min(weights) < 0:
        return f"{split!r} has a negative weight: give each of train, valid, test a weight >= 0"
    if sum(weights) == 0:
        return (
            f"{split!r} gives every split weight 0: give the training split a weight above 0 "
            "(969,30,1)"
        )
    return None


def blend_problem(words: str) -> str | None:
    """What is wrong with a data path's words (Megatron-Core's ``get_blend_from_list``:
    prefixes, or weight-prefix pairs with weights >= 0), or None."""
    items = words.split()
    pairs = "pairs of a weight and a prefix (0.7 data/a_text_document 0.3 data/b_text_document)"
    if len(items) % 2 == 1:
        number = next((w for w in items if _FLOAT.match(w)), None)
        if number is None or len(items) == 1:
            return None
        return (
            f"{words!r} has {len(items)} words, among them the number {number!r}: a blend "
            f"alternates weight and prefix, so give dataset prefixes alone, or {pairs}"
        )
    weights = items[0::2]
    if not all(_FLOAT.match(w) for w in weights):
        odd = next(w for w in weights if not _FLOAT.match(w))
        return f"{odd!r} stands where a blend weight goes: give dataset prefixes alone, or {pairs}"
    if min(float(w) for w in weights) < 0:
        negative = next(w for w in weights if float(w) < 0)
        return f"blend weight {negative} is negative: give each dataset a weight >= 0"
    if max(float(w) for w in weights) == 0:
        return "every blend weight is 0: give at least one dataset a weight above 0"
    return None


def _check_data(cfg: TrainConfig) -> Problem:
    """Where the tokens come from: data_path (with split), the per-split paths, mock_data,
    or (none of them) the synthetic data."""
    per_split = [k for k in DATA_PATH_KEYS[1:] if getattr(cfg, k) is not None]
    if cfg.data_path is not None and per_split:
        return per_split[0], (
            "and data_path are both set: choose data_path (split by split) or the per-split paths"
        )
    if cfg.mock_data and (cfg.data_path is not None or per_split):
        return "mock_data", "replaces data files: unset it, or unset the data paths"
    if per_split and cfg.train_data_path is None:
        return "train_data_path", f"required with {per_split[0]}: the training split's datasets"
    for key in DATA_PATH_KEYS:
        value = getattr(cfg, key)
        problem = None if value is None else blend_problem(value)
        if problem is not None:
            return key, problem
    problem = split_problem(cfg.split)
    if problem is not None:
        return "split", problem
    if not cfg.uses_data_files and not cfg.mock_data:
        for key in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(cfg, key):
                return key, (
                    "applies to documents of data_path or mock_data; the synthetic data has none"
                )
    if cfg.eval_interval is not None and cfg.uses_data_files:
        if cfg.data_path is not None and split_weights(cfg.split)[1] == 0:
            return "split", (
                f"{cfg.split!r} gives the validation split no documents but eval_interval is "
                "set: give it a weight (969,30,1) or unset eval_interval"
            )
        if cfg.train_data_path is not None and cfg.valid_data_path is None:
            return "valid_data_path", (
                "required with eval_interval and train_data_path: the validation split's datasets"
            )
    return None


#: The file keys each tokenizer reads.
_TOKENIZER_FILES = {
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "NullTokenizer": (),
}


def _check_tokenizer(cfg: TrainConfig) -> Problem:
    """A tokenizer exactly where data files or mock data need one, with its files; the
    vocabulary size given only where no tokenizer gives it."""
    kind = cfg.tokenizer_type
    needs = cfg.uses_data_files or cfg.mock_data
    if needs and kind is None:
        return "tokenizer_type", (
            "is required with data_path or mock_data: HuggingFaceTokenizer (with "
            "tokenizer_model), GPT2BPETokenizer (with vocab_file and merge_file) or NullTokenizer "
            "(with vocab_size)"
        )
    if kind is not None and not needs:
        return "tokenizer_type", (
            "tokenizes data_path or mock_data, and neither is set: set one, or unset "
            "tokenizer_type to train on the synthetic tokens"
        )
    wanted = _TOKENIZER_FILES.get(kind, ())
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        value = getattr(cfg, key)
        if value is not None and key not in wanted:
            return key, f"is read by {_reader_of(key)}, not {kind or 'the synthetic data'}"
        if value is None and key in wanted:
            return key, f"is required with tokenizer_type {kind}"
    gives_vocab = kind in ("HuggingFaceTokenizer", "GPT2BPETokenizer")
    if gives_vocab and cfg.vocab_size is not None:
        return "vocab_size", (
            f"comes from the tokenizer ({kind}, padded to a multiple of "
            "make_vocab_size_divisible_by x TP): unset it"
        )
    if not gives_vocab and cfg.vocab_size is None:
        what = "NullTokenizer" if kind == "NullTokenizer" else "the synthetic data"
        return "vocab_size", f"is required for {what} (token ids below it)"
    return None


def _reader_of(key: str) -> str:
    return next(kind for kind, keys in _TOKENIZER_FILES.items() if key in keys)
