"""Per-stage costs of a GPT model, from its shape: FLOPs of forward (F), input gradient
(B, dX) and weight gradient (W, dW), parameters and saved activations. Pure Python.

A GEMM of an (m x k) and a (k x n) matrix is ``2mkn`` FLOPs, and its dX and its dW each
cost as much again, as Megatron-LM's ``num_floating_point_operations`` counts;
elementwise work is not counted. Activation recomputation (:class:`Recompute`,
Megatron-Core's keys) adds its forward work to B; what it takes off memory is
:mod:`.memory`'s. The counting in full: docs/advisor.md, "Costs from the model's shape".
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..schedules.config_values import check_positive, read_fields
from ..schedules.ir import ScheduleError
from ..schedules.layout import DECODER, EMBEDDING, LOSS, MTP

__all__ = [
    "RECOMPUTE_MODULES",
    "ModelShape",
    "Recompute",
    "StageCost",
    "Work",
    "parse_moe_layer_freq",
    "stage_costs",
]


#: Megatron-Core's ``recompute_modules`` choices (TransformerConfig).
RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)


@dataclass(frozen=True)
class Recompute:
    """Megatron-Core's activation recomputation settings, from the keys
    ``recompute_granularity``, ``recompute_method``, ``recompute_num_layers`` and
    ``recompute_modules`` (words; Megatron-Core's default ``core_attn``): the one reading of
    them for FLOPs (here) and memory (:mod:`.memory`)."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    modules: str | None = None

    def problem(self) -> tuple[str, str] | None:
        """Megatron-Core's rules for the keys: ``(key, what is wrong)``, or None."""
        if self.granularity not in (None, "full", "selective"):
            return "recompute_granularity", f"{self.granularity!r} is not one of full, selective"
        if self.method not in (None, "uniform", "block"):
            return "recompute_method", f"{self.method!r} is not one of uniform, block"
        full_only = {"recompute_method": self.method, "recompute_num_layers": self.num_layers}
        for key, value in full_only.items():
            if value is not None and self.granularity != "full":
                return key, "applies to recompute_granularity: full: set that, or unset this"
        if self.granularity == "full" and (self.method is None or not self.num_layers):
            return "recompute_granularity", (
                "full needs recompute_method (uniform or block) and recompute_num_layers (layers "
                "per recomputed group, or recomputed layers per stage)"
            )
        if self.modules is None:
            return None
        if self.granularity != "selective":
            return "recompute_modules", "applies to recompute_granularity: selective"
        unknown = [m for m in self.modules.split() if m not in RECOMPUTE_MODULES]
        if unknown:
            return "recompute_modules", (
                f"{unknown[0]!r} is not one of Megatron-Core's {', '.join(RECOMPUTE_MODULES)}"
            )
        return None

    @property
    def module_set(self) -> frozenset[str]:
        """The selectively recomputed modules (none unless ``selective``)."""
        if self.granularity != "selective":
            return frozenset()
        return frozenset((self.modules or "core_attn").split())

    def full_layers(self, layers: int) -> tuple[int, int]:
        """Under full recomputation, of a stage's ``layers``: how many are recomputed and
        how many inputs they keep."""
        if self.granularity != "full" or not layers:
            return 0, 0
        n = max(1, self.num_layers or 1)
        if self.method == "block":
            return min(n, layers), min(n, layers)
        return layers, math.ceil(layers / n)

    def describe(self) -> str:
        """One phrase: ``no recomputation``, ``recompute full (...)`` or ``recompute
        selective (...)``."""
        if self.granularity == "full":
            return f"recompute full ({self.method}, recompute_num_layers {self.num_layers})"
        if self.granularity == "selective":
            return f"recompute selective ({' '.join(sorted(self.module_set))})"
        return "no recomputation"


@dataclass(frozen=True)
class Work:
    """FLOPs of forward, input gradient and weight gradient of one part of the model."""

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0

    @staticmethod
    def gemm(flops: float) -> Work:
        """A weight's GEMM: its dX and its dW each cost its forward."""
        return Work(flops, flops, flops)

    @staticmethod
    def core(flops: float) -> Work:
        """A product of two activations (attention): no weight, so dX for both inputs."""
        return Work(flops, 2 * flops, 0.0)

    def __add__(self, other: Work) -> Work:
        return Work(self.f + other.f, self.b + other.b, self.w + other.w)

    def __mul__(self, k: float) -> Work:
        return Work(self.f * k, self.b * k, self.w * k)

    @property
    def total(self) -> float:
        return self.f + self.b + self.w


_POSITIVE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
    "moe_router_topk",
    "kv_lora_rank",
    "qk_head_dim",
    "v_head_dim",
)
_POSITIVE_OR_NULL = (
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "q_lora_rank",
)


@dataclass(frozen=True)
class ModelShape:
    """A GPT's shape in Megatron-LM's keys (defaults: Megatron-Core's model defaults, which
    Megatron-LM builds with: ``ffn_hidden_size`` 4 x hidden, ``kv_channels`` hidden / heads,
    ``moe_ffn_hidden_size`` = ``ffn_hidden_size``; MLA dimensions: Megatron-LM's flag
    defaults). ``moe_layer_freq`` is Megatron's: an integer N (every N-th layer is MoE,
    from layer 0), a list of 0/1, or its string form such as ``"[0]*3+[1]*58"``.
    ``qk_layernorm`` (Megatron's): under MLA its two low-rank norms (of the query's
    ``q_lora_rank`` when set and the key-value ``kv_lora_rank``, as DeepSeek-V3 has them),
    otherwise one norm of the head size for the queries and one for the keys."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    ffn_hidden_size: int | None = None
    swiglu: bool = False
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True
    position_embedding_type: str = "learned_absolute"
    max_position_embeddings: int | None = None
    untie_embeddings_and_output_weights: bool = False
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: object = 1
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    qk_layernorm: bool = False
    mtp_num_layers: int | None = None

    def __post_init__(self) -> None:
        check_positive(self, _POSITIVE)
        check_positive(self, _POSITIVE_OR_NULL, nullable=True)
        if self.qk_pos_emb_head_dim < 0 or (self.mtp_num_layers or 0) < 0:
            raise ScheduleError("qk_pos_emb_head_dim and mtp_num_layers must not be negative")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ScheduleError(
                f"normalization: {self.normalization!r} is not one of LayerNorm, RMSNorm"
            )
        if self.num_experts is None and self.moe_shared_expert_intermediate_size is not None:
            raise ScheduleError("moe_shared_expert_intermediate_size: needs num_experts")
        if self.num_experts is not None and self.moe_router_topk > self.num_experts:
            raise ScheduleError(f"moe_router_topk: must not exceed num_experts {self.num_experts}")
        if self.hidden_size % self.num_attention_heads and self.kv_channels is None:
            raise ScheduleError(
                f"num_attention_heads: {self.num_attention_heads} does not divide hidden_size "
                f"{self.hidden_size}: set kv_channels"
            )
        groups = self.num_query_groups
        if groups is not None and self.num_attention_heads % groups:
            raise ScheduleError(
                f"num_query_groups: {groups} must divide num_attention_heads "
                f"{self.num_attention_heads}"
            )
        object.__setattr__(self, "_moe", _moe_pattern(self))

    @staticmethod
    def from_values(
        values: dict, source: str, origins: Mapping[str, str] | None = None
    ) -> ModelShape:
        """Read the shape from a config's values; :class:`ConfigValueError` naming the key.
        ``num_query_groups`` counts only with ``group_query_attention``, as Megatron-LM's
        ``core_transformer_config_from_args`` reads it (without, every head its own group;
        with, Megatron-LM's default is one group)."""
        if not values.get("group_query_attention"):
            values = {**values, "num_query_groups": None}
        elif values.get("num_query_groups") is None:
            values = {**values, "num_query_groups": 1}
        return read_fields(ModelShape, values, source, origins)

    def summary(self) -> str:
        """One line: the layers, attention, experts, MTP, vocabulary and sequence."""
        n, moe = self.num_layers, sum(self._moe)  # type: ignore[attr-defined]
        layers = f"{n} decoder layers"
        if self.num_experts is not None:
            shared = " + shared expert" if self.moe_shared_expert_intermediate_size else ""
            experts = f"{self.num_experts} experts top-{self.moe_router_topk}{shared}"
            layers += f" ({n - moe} dense, {moe} MoE: {experts})"
        attention = "MLA" if self.multi_latent_attention else "attention"
        if not self.multi_latent_attention:
            groups = self.num_query_groups or self.num_attention_heads
            attention = f"{self.num_attention_heads} heads" + (
                f" in {groups} query groups" if groups != self.num_attention_heads else ""
            )
        mtp = f", MTP {self.mtp_layers}" if self.mtp_layers else ""
        return (
            f"{layers}, {attention}{mtp}, hidden {self.hidden_size:,}, vocab "
            f"{self.vocab_size:,}, sequence {self.seq_length:,}"
        )

    # -- the model's parts --------------------------------------------------------------
    @property
    def mtp_layers(self) -> int:
        return self.mtp_num_layers or 0

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has MoE experts; MTP layers (``layer``
        at or past ``num_layers``) are of the last decoder layer's kind, as in Megatron."""
        pattern: tuple[bool, ...] = self._moe  # type: ignore[attr-defined]
        return pattern[min(layer, self.num_layers - 1)]

    def _up(self, ffn: int) -> int:
        """Width of an MLP's first projection (SwiGLU's gate and up stacked)."""
        return 2 * ffn if self.swiglu else ffn

    def _norm_params(self) -> int:
        return self.hidden_size * (1 if self.normalization == "RMSNorm" else 2)

    def qk_norm_params(self) -> int:
        """Parameters of the query and key norms (``qk_layernorm``; 0 without)."""
        if not self.qk_layernorm:
            return 0
        per = 1 if self.normalization == "RMSNorm" else 2
        if self.multi_latent_attention:
            return per * (self.kv_lora_rank + (self.q_lora_rank or 0))
        return per * 2 * self.head_dim

    def _attention(self) -> tuple[Work, int, int, int]:
        """Per token: the attention block's work, its parameters, and its saved activations
        as (replicated elements, tensor-parallel elements, fp32 softmax statistics)."""
        h, n = self.hidden_size, self.num_attention_heads
        if self.multi_latent_attention:
            dn, r, v = self.qk_head_dim, self.qk_pos_emb_head_dim, self.v_head_dim
            lq, lkv = self.q_lora_rank, self.kv_lora_rank
            q_params = h * n * (dn + r) if lq is None else lq * (h + n * (dn + r))
            weights = q_params + h * (lkv + r) + lkv * n * (dn + v) + n * v * h
            params = weights + self._norm_params() + self.qk_norm_params()
            replicated = 2 * h + (0 if lq is None else 2 * lq) + (lkv + r) + lkv
            sharded = 2 * n * (dn + r) + 2 * n * v
        else:
            d, g = self.head_dim, self.num_query_groups or n
            weights = h * (n * d + 2 * g * d) + n * d * h
            bias = (n * d + 2 * g * d + h) if self.add_bias_linear else 0
            params = weights + bias + self._norm_params() + self.qk_norm_params()
            replicated, sharded = 2 * h, 2 * n * d + 2 * g * d
        return Work.gemm(2 * weights) + self.core_attention(), params, replicated, sharded

    def core_attention(self) -> Work:
        """Per token: the attention products (scores and values; causal: half of them)."""
        n, s = self.num_attention_heads, self.seq_length
        if self.multi_latent_attention:
            dn, r, v = self.qk_head_dim, self.qk_pos_emb_head_dim, self.v_head_dim
            return Work.core(2 * n * (dn + r) * s / 2 + 2 * n * v * s / 2)
        return Work.core(2 * n * self.head_dim * s / 2 * 2)

    def _mlp(self, moe: bool) -> tuple[Work, int, int, int, int, int]:
        """Per token: the MLP block's work, its dense and expert parameters, and its saved
        activations (replicated elements, tensor-parallel elements, fp32 elements)."""
        h = self.hidden_size
        if not moe:
            f = self.ffn
            weights = self._up(f) * h + f * h
            bias = (self._up(f) + h) if self.add_bias_linear else 0
            return (
                Work.gemm(2 * weights),
                weights + bias + self._norm_params(),
                0,
                2 * h,
                self._up(f) + f,
                0,
            )
        e, k = self.num_experts or 1, self.moe_router_topk
        fe = self.moe_ffn_hidden_size or self.ffn
        fs = self.moe_shared_expert_intermediate_size or 0
        expert = self._up(fe) * h + fe * h
        shared = self._up(fs) * h + fs * h
        work = Work.gemm(2 * (e * h + k * expert + shared))
        dense_params = e * h + shared + self._norm_params()
        sharded = k * (2 * h + self._up(fe) + fe) + self._up(fs) + fs
        return work, dense_params, e * expert, 2 * h, sharded, e

    def decoder_layer(self, layer: int) -> tuple[Work, int, int, int, int, int]:
        """Per token, decoder layer ``layer``: work, dense and expert parameters, saved
        activations (replicated, tensor-parallel and fp32 elements)."""
        a_work, a_params, a_rep, a_shard = self._attention()
        m_work, m_dense, m_expert, m_rep, m_shard, m_fp32 = self._mlp(self.is_moe(layer))
        stats = self.num_attention_heads
        return (
            a_work + m_work,
            a_params + m_dense,
            m_expert,
            a_rep + m_rep,
            a_shard + m_shard,
            stats + m_fp32,
        )

    def logits(self) -> Work:
        """Per token: one output layer's GEMM and its cross-entropy loss (the loss is
        elementwise: 4 FLOPs per logit forward, 3 backward)."""
        v = self.vocab_size
        return Work.gemm(2 * self.hidden_size * v) + Work(4 * v, 3 * v, 0.0)


@dataclass(frozen=True)
class StageCost:
    """One model stage for one micro-batch on one rank: ``work`` in FLOPs, ``activations``
    saved in bytes, parameters (``dense_params``; ``expert_params`` are split over expert
    parallelism) and which shared matrices it needs (the embedding table, the output
    layer: a tied pair on one rank is stored once). ``moe``: the FLOPs of its MoE layers
    (MTP's included), which its all-to-all scales with (not the forward that full
    recomputation runs again in B: a profile's timing takes no recomputation); ``a2a``:
    that all-to-all's milliseconds in F and in B, once a profile timed the stage (else 0)."""

    work: Work
    activations: float
    dense_params: float
    expert_params: float
    embedding: bool
    output_layer: bool
    first_layer: int
    layers: int
    moe: Work = Work()
    a2a: tuple[float, float] = (0.0, 0.0)

    @property
    def f(self) -> float:
        return self.work.f

    @property
    def b(self) -> float:
        return self.work.b

    @property
    def w(self) -> float:
        return self.work.w


def stage_costs(
    shape: ModelShape,
    stages: list[str],
    *,
    tokens: int,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    expert_parallel: int = 1,
    activation_bytes: int = 2,
    recompute: Recompute | None = None,
) -> list[StageCost]:
    """Costs of each stage of a layout (:mod:`.layout`'s strings, in pipeline order) for a
    micro-batch of ``tokens`` tokens on one rank of a ``tensor_parallel`` group, with
    ``recompute``'s extra forward in B (docs/advisor.md); ``activations``: what each stage
    saves without recomputation."""
    tp, h, v = tensor_parallel, shape.hidden_size, shape.vocab_size
    replicated_share = 1 / tp if sequence_parallel else 1.0
    recompute = recompute or Recompute()
    modules = recompute.module_set
    out: list[StageCost] = []
    layer = 0
    for stage in stages:
        work, moe, dense, expert, act = Work(), Work(), 0.0, 0.0, 0.0
        first = layer
        recomputed, _ = recompute.full_layers(stage.count(DECODER))
        for index, part in enumerate(stage):
            if part in (DECODER, MTP):
                lw, ld, le, rep, shard, fp32 = shape.decoder_layer(layer)
                work += lw
                if shape.is_moe(layer):
                    moe += lw
                dense += ld
                expert += le
                if part == DECODER and stage[:index].count(DECODER) < recomputed:
                    work += Work(0.0, lw.f, 0.0)  # B runs the layer's forward again
                elif part == DECODER and modules:
                    work += _selective(shape, layer, modules)
                act += activation_bytes * (rep * replicated_share + shard / tp) + 4 * fp32 / tp
                if part == DECODER:
                    layer += 1
                else:  # the MTP block's norms of the embedding and hidden input, and eh_proj
                    work += Work.gemm(2 * 2 * h * h)
                    dense += 2 * h * h + 3 * h
                    act += activation_bytes * 4 * h * replicated_share
            elif part == EMBEDDING:
                # A lookup; its dW adds each token's gradient into its row.
                work += Work(0.0, 0.0, h)
                if shape.position_embedding_type == "learned_absolute":
                    dense += (shape.max_position_embeddings or shape.seq_length) * h
            elif part == LOSS:
                heads = 1 + shape.mtp_layers
                work += shape.logits() * heads
                dense += shape._norm_params()
                act += heads * (activation_bytes * 2 * h * replicated_share + 4 * v / tp)
        out.append(
            StageCost(
                work=work * (tokens / tp),
                activations=act * tokens,
                dense_params=dense / tp,
                expert_params=expert / (tp * expert_parallel),
                embedding=EMBEDDING in stage or MTP in stage,
                output_layer=LOSS in stage,
                first_layer=first,
                layers=layer - first,
                moe=moe * (tokens / tp),
            )
        )
    return out


def _selective(shape: ModelShape, layer: int, modules: frozenset[str]) -> Work:
    """The work selective recomputation of decoder layer ``layer`` adds to its B."""
    extra = Work()
    if "core_attn" in modules:
        extra += Work(0.0, shape.core_attention().f, 0.0)
    moe = shape.is_moe(layer)
    if ("moe" if moe else "mlp") in modules:
        extra += Work(0.0, shape._mlp(moe)[0].f, 0.0)
    return extra


def _moe_pattern(shape: ModelShape) -> tuple[bool, ...]:
    """Which decoder layers are MoE, from ``moe_layer_freq`` (all dense without experts)."""
    n, freq = shape.num_layers, shape.moe_layer_freq
    freq = 1 if freq is None else freq  # Megatron's default: every layer
    if shape.num_experts is None:
        return (False,) * n
    if isinstance(freq, bool):
        raise ScheduleError(f"moe_layer_freq: expected an integer or a list, got {freq!r}")
    if isinstance(freq, int):
        if freq < 1:
            raise ScheduleError(f"moe_layer_freq: must be >= 1, got {freq}")
        return tuple(i % freq == 0 for i in range(n))
    pattern = _pattern_list(freq)
    if len(pattern) != n or any(x not in (0, 1) for x in pattern):
        raise ScheduleError(
            f"moe_layer_freq: the pattern must list num_layers = {n} entries of 0 (dense) or "
            f"1 (MoE), got {len(pattern)} entries"
        )
    return tuple(bool(x) for x in pattern)


def _pattern_list(freq: object) -> list:
    """Megatron's list form of ``moe_layer_freq``: a list, or a string such as
    ``"([0]*3+[1]*58)"`` (list literals joined by + and repeated by *), read without eval."""
    if isinstance(freq, list):
        return freq
    if isinstance(freq, str):
        try:
            value = parse_moe_layer_freq(freq)
        except ValueError:
            value = None
        if isinstance(value, list):
            return value
        if isinstance(value, int):
            raise ScheduleError(f"moe_layer_freq: write the integer {value} without quotes")
    raise ScheduleError(
        f"moe_layer_freq: expected an integer, a list of 0/1 or a string such as "
        f"'[0]*3+[1]*58', got {freq!r}"
    )


def parse_moe_layer_freq(text: str) -> int | list:
    """Megatron-LM's ``--moe-layer-freq`` text: an integer, or list literals joined by + and
    repeated by * (``([0]*3+[1]*58)``), read without eval; ValueError otherwise."""
    try:
        return _evaluate(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, TypeError) as err:
        raise ValueError(f"not an integer or a list expression: {text!r}") from err


def _evaluate(node: ast.AST) -> list | int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
        left, right = _evaluate(node.left), _evaluate(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("not a list expression")
