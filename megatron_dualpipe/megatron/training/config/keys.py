"""The training configuration's keys: :class:`TrainConfig`, one field per key with its
documentation and Megatron-LM spellings, and the table a command line offers
(:func:`config_keys`). No torch or megatron import."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ....errors import DualPipeError
from ....planner.model_cost import parse_moe_layer_freq
from ....schedules.cuda_graphs import CUDA_GRAPH_IMPLS
from ....schedules.registry import SCHEDULES
from ...schedule.checks import schedule_spec, stage_layers

__all__ = [
    "CHOICES",
    "FIELDS",
    "INT_OR_STRING",
    "NUMBER",
    "OPTIMIZE_AFTER",
    "TYPES",
    "WORD_LISTS",
    "ConfigError",
    "ConfigKey",
    "Problem",
    "TrainConfig",
    "base_type",
    "config_keys",
    "is_required",
]

#: A number as YAML or a command line writes it.
NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
#: A check's finding: the key and what to change, or None where the check passes.
Problem = tuple[str, str] | None

#: Iterations ``optimize_schedule`` runs (and measures) the hand-made order before it
#: switches: the first warms up, the second is measured.
OPTIMIZE_AFTER = 2


class ConfigError(DualPipeError, ValueError):
    """A configuration that cannot run; the message names the source, the key and the fix."""


def _key(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    megatron_lm: bool = True,
) -> Any:
    """A config field with its one-line documentation; the key is the Megatron-LM argument
    of its name (``megatron_lm=False``: megatron-dualpipe's own key)."""
    metadata = {"doc": doc, "megatron_lm": megatron_lm}
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
        doc="model chunks per pipeline rank for interleaved-1f1b",
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
        "dualpipev); transformer_engine (Transformer Engine's per-layer graphs, captured "
        "after the warm-up in the schedule's order: under zb1p, dualpipe and dualpipev the "
        "same parts as local); needs CUDA",
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
    add_bias_linear: bool = _key(True, doc="bias terms in the linear layers")
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
    )
    fp8: str | None = _key(
        None,
        doc="FP8 training through Transformer Engine: e4m3, or hybrid (e5m2 gradients); "
        "unset: none",
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
    )
    ckpt_step: int | None = _key(None, doc="iteration to load (default: the latest)")
    override_opt_param_scheduler: bool = _key(
        False,
        doc="on resume, take the learning-rate schedule from the config",
    )
    use_checkpoint_opt_param_scheduler: bool = _key(
        False,
        doc="on resume, take the learning-rate schedule from the checkpoint",
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
        from .rules import validated  # the rules import this module

        return validated(dataclasses.replace(self, world_size=world_size), source)


#: The values a key with a fixed set of choices takes.
CHOICES: dict[str, tuple[str | None, ...]] = {
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
#: String keys whose Megatron-LM flag also takes an integer.
INT_OR_STRING = ("moe_layer_freq",)
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
#: Every key's dataclass field, and its type.
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
TYPES = typing.get_type_hints(TrainConfig)


@dataclass(frozen=True)
class ConfigKey:
    """One key of :class:`TrainConfig`: its name, documentation, type and default."""

    name: str
    doc: str
    #: The Megatron-LM argument of its name (False: megatron-dualpipe's own key).
    megatron_lm: bool
    #: ``int``, ``float``, ``bool`` or ``str`` (None allowed where the default is None).
    type: type
    required: bool
    default: Any
    choices: tuple[str, ...] | None


def config_keys() -> tuple[ConfigKey, ...]:
    """Every key of :class:`TrainConfig` in definition order, with its documentation (from
    the field definitions)."""
    return tuple(
        ConfigKey(
            name=f.name,
            doc=f.metadata["doc"],
            megatron_lm=f.metadata["megatron_lm"],
            type=base_type(TYPES[f.name])[0],
            required=is_required(f),
            default=f.default,
            choices=tuple(c for c in CHOICES[f.name] if c is not None)
            if f.name in CHOICES
            else None,
        )
        for f in FIELDS.values()
    )


def is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def base_type(tp: Any) -> tuple[type, bool]:
    """``int | None`` -> (int, True); ``int`` -> (int, False)."""
    if isinstance(tp, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False
