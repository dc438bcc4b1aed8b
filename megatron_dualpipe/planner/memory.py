"""Per-rank memory of a training run, before booking a cluster: what one GPU holds for each
pipeline rank of a config under its schedule, part by part, in bytes. Pure Python.

The parts are weights, gradients, optimizer states (with and without the distributed
optimizer), activations (the peak over the rank's order of work in the schedule, from each
F to its B, and from B to W for the deferred weight gradients) and what recomputation
rebuilds inside a B, following Megatron-Core's ``recompute_granularity``. Temporary
buffers, the CUDA context and fragmentation are not counted; NCCL's buffers are
:mod:`.nccl_memory`'s. What each part counts: docs/memory.md, "Memory per rank".
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..schedules.config_values import read_fields
from ..schedules.ir import Kind, Schedule, ScheduleError
from ..schedules.layout import DECODER, EMBEDDING, LOSS, MTP
from .model_cost import ModelShape, Recompute

__all__ = [
    "Held",
    "LayerMemory",
    "MemoryModel",
    "MemorySettings",
    "PhasePeaks",
    "RankMemory",
    "StageMemory",
    "decoder_layer_memory",
]

GIB = 2**30


@dataclass(frozen=True)
class MemorySettings:
    """What decides memory besides the shape and the parallel layout, in a training
    config's keys: FP8 training (``fp8``: Megatron-LM's ``--fp8-format``) and Megatron-Core's
    activation recomputation, read as :class:`.model_cost.Recompute` (which also gives its
    FLOPs)."""

    fp8: str | None = None
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    #: Words, or a list of them as Megatron-LM's ``--recompute-modules`` takes them.
    recompute_modules: object = None

    def __post_init__(self) -> None:
        modules = self.recompute_modules
        if isinstance(modules, list | tuple) and all(isinstance(m, str) for m in modules):
            object.__setattr__(self, "recompute_modules", " ".join(modules))
        elif modules is not None and not isinstance(modules, str):
            raise ScheduleError(
                f"recompute_modules: expected module names (a list, or words), got {modules!r}"
            )
        if self.fp8 not in (None, "e4m3", "hybrid"):
            raise ScheduleError(f"fp8: {self.fp8!r} is not one of e4m3, hybrid")
        problem = self.recompute.problem()
        if problem is not None:
            raise ScheduleError(": ".join(problem))

    @staticmethod
    def from_values(
        values: Mapping[str, object], source: str, origins: Mapping[str, str] | None = None
    ) -> MemorySettings:
        """Read the settings from a config's values; :class:`ConfigValueError` naming the key."""
        return read_fields(MemorySettings, values, source, origins)

    @property
    def recompute(self) -> Recompute:
        """The recomputation these keys configure."""
        return Recompute(
            self.recompute_granularity,
            self.recompute_method,
            self.recompute_num_layers,
            self.recompute_modules,
        )

    def describe(self) -> str:
        """One phrase: the precision and the recomputation."""
        precision = f"FP8 ({self.fp8})" if self.fp8 else "no FP8"
        return f"{precision}, {self.recompute.describe()}"


@dataclass(frozen=True)
class Held:
    """A tensor a layer holds, per token: its elements, whether tensor parallelism splits
    it, its kind (``act``: bf16 or fp32 as the model trains; ``lin``: a linear layer's
    input, FP8 under FP8 training; ``grad``: a linear layer's output gradient, FP8 under
    FP8 training, whose weight-gradient GEMM is FP8; ``fp32``), and the recompute module
    that drops it (``kept``: none does)."""

    elements: float
    sharded: bool
    kind: str
    module: str = "kept"


@dataclass(frozen=True)
class LayerMemory:
    """One decoder layer: the tensors it saves from F to B, and the ones its deferred
    weight gradients hold from B to W (each linear layer's input and output gradient)."""

    saved: tuple[Held, ...]
    for_w: tuple[Held, ...]


def _linear(inputs: float, in_sharded: bool, outputs: float, out_sharded: bool) -> list[Held]:
    """What one deferred linear layer's dW holds from B to W."""
    return [Held(inputs, in_sharded, "lin"), Held(outputs, out_sharded, "grad")]


def decoder_layer_memory(shape: ModelShape, layer: int) -> LayerMemory:
    """Decoder layer ``layer``'s :class:`LayerMemory` (attention, then MLP or MoE)."""
    s = shape
    h, n = s.hidden_size, s.num_attention_heads
    up = (lambda f: 2 * f) if s.swiglu else (lambda f: f)
    saved = [
        Held(2 * h, False, "act"),  # the two norms' inputs
        Held(2 * h, False, "lin", "layernorm"),  # their outputs: the projections' inputs
        Held(n, True, "fp32"),  # flash attention's softmax statistics
    ]
    w: list[Held] = []
    if s.multi_latent_attention:
        dn, r, v = s.qk_head_dim, s.qk_pos_emb_head_dim, s.v_head_dim
        lq, lkv = s.q_lora_rank, s.kv_lora_rank
        if lq is not None:  # down projection out, its norm's output (the up projection's in)
            saved += [Held(lq, False, "act"), Held(lq, False, "lin")]
            w += _linear(h, False, lq, False) + _linear(lq, False, n * (dn + r), True)
        else:
            w += _linear(h, False, n * (dn + r), True)
        saved += [Held(lkv + r, False, "act"), Held(lkv, False, "lin")]
        saved += [Held(2 * n * (dn + r) + n * v, True, "act", "mla_up_proj")]  # Q, K, V
        saved += [Held(n * v, True, "lin")]  # attention output: the output projection's in
        w += _linear(h, False, lkv + r, False) + _linear(lkv, False, n * (dn + v), True)
        w += _linear(n * v, True, h, False)
    else:
        d, g = s.head_dim, s.num_query_groups or n
        saved += [Held(n * d + 2 * g * d, True, "act"), Held(n * d, True, "lin")]
        w += _linear(h, False, n * d + 2 * g * d, True) + _linear(n * d, True, h, False)
    if not s.is_moe(layer):
        f = s.ffn
        saved += [Held(up(f), True, "act", "mlp"), Held(f, True, "lin", "mlp")]
        w += _linear(h, False, up(f), True) + _linear(f, True, h, False)
    else:
        k, fe = s.moe_router_topk, s.moe_ffn_hidden_size or s.ffn
        fs = s.moe_shared_expert_intermediate_size or 0
        saved += [
            Held(s.num_experts or 1, True, "fp32", "moe"),  # router probabilities
            Held(k * h, True, "lin", "moe"),  # routed copies: the experts' inputs
            Held(k * up(fe), True, "act", "moe"),  # fc1 outputs
            Held(k * fe, True, "lin", "moe_act"),  # activation outputs: fc2's inputs
            Held(k * h, True, "act", "moe"),  # expert outputs, before the combine
        ]
        w += _linear(k * h, True, k * up(fe), True) + _linear(k * fe, True, k * h, True)
        if fs:
            saved += [
                Held(up(fs), True, "act", "shared_experts"),
                Held(fs, True, "lin", "shared_experts"),
            ]
            w += _linear(h, False, up(fs), True) + _linear(fs, True, h, False)
    return LayerMemory(tuple(saved), tuple(w))


def _dropped(recompute: Recompute, moe: bool) -> set[str]:
    """The :class:`Held` modules selective recomputation drops in one layer."""
    modules = recompute.module_set
    drop = {m for m in ("layernorm", "mla_up_proj", "moe_act", "shared_experts") if m in modules}
    if ("moe" if moe else "mlp") in modules:
        drop |= {"moe", "moe_act", "shared_experts"} if moe else {"mlp"}
    return drop


@dataclass(frozen=True)
class StageMemory:
    """One model stage: parameters on one rank of its tensor-parallel group (dense, norms
    and router whole; expert; the linear layers' weights among them;
    embedding and output tables apart) and, per micro-batch, bytes saved from F to B, held
    from B to W, and the largest layer's bytes recomputation rebuilds inside a B."""

    dense: float
    expert: float
    linear_weights: float
    embedding_table: bool
    output_table: bool
    saved: float
    held_for_w: float
    rebuilt: float


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes, part by part (docs/memory.md); ``weights`` includes
    Transformer Engine's cached FP8 copies of the linear weights under FP8; the optimizer
    states with the distributed optimizer and without, ``distributed`` the config's."""

    rank: int
    stages: tuple[int, ...]
    params: float
    expert_params: float
    weights: float
    gradients: float
    optimizer_distributed: float
    optimizer_not_distributed: float
    activations: float
    recompute: float
    distributed: bool

    @property
    def optimizer(self) -> float:
        """The optimizer states as the config keeps them."""
        return self.optimizer_distributed if self.distributed else self.optimizer_not_distributed

    @property
    def total(self) -> float:
        """Everything, as the config keeps it."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.recompute

    def total_with(self, distributed: bool) -> float:
        """Everything, with the distributed optimizer or without it."""
        states = self.optimizer_distributed if distributed else self.optimizer_not_distributed
        return self.total - self.optimizer + states


class PhasePeaks:
    """Each rank's activation peak over its order of work, for per-model-stage sizes of
    what a micro-batch holds from F to B and from B to W (read the order once)."""

    def __init__(self, schedule: Schedule):
        p = schedule.placement
        self.stages = [
            [p.model_stage(p.stage_of(r, c)) for c in range(p.num_chunks)]
            for r in range(p.num_ranks)
        ]
        self.vectors = [self._vectors(schedule, r) for r in range(p.num_ranks)]

    def __call__(self, saved: list[float], held: list[float]) -> list[float]:
        out = []
        for stages, vectors in zip(self.stages, self.vectors, strict=True):
            sizes = [saved[s] for s in stages] + [held[s] for s in stages]
            out.append(max((sum(map(float.__mul__, sizes, v)) for v in vectors), default=0.0))
        return out

    @staticmethod
    def _vectors(schedule: Schedule, rank: int) -> list[tuple[float, ...]]:
        """(micro-batches between F and B per chunk, then between B and W per chunk) at
        each instant a count rises, dominated instants dropped."""
        p = schedule.placement
        chunks = p.num_chunks
        live = [0] * (2 * chunks)
        seen: set[tuple[float, ...]] = set()
        for action in schedule.ranks[rank]:
            halves = action.sub or (action,)
            for h in halves:  # the forward half allocates first
                if h.kind is Kind.F:
                    live[p.chunk_of(h.stage)] += 1
                    seen.add(tuple(map(float, live)))
            for h in halves:
                c = p.chunk_of(h.stage)
                if h.kind is Kind.B:
                    live[c] -= 1
                    live[chunks + c] += 1
                    seen.add(tuple(map(float, live)))
                elif h.kind is Kind.BW:
                    live[c] -= 1
                elif h.kind is Kind.W:
                    live[chunks + c] -= 1
        return [v for v in seen if not any(o != v and all(map(float.__ge__, o, v)) for o in seen)]


class MemoryModel:
    """Per-rank memory of ``shape`` split into ``stages`` (layout strings in pipeline
    order) under ``schedule``, for a micro-batch of ``tokens`` tokens, with ``settings``'
    recomputation and FP8 (Transformer Engine's FP8 training: linear layers' inputs and
    their output gradients held in FP8, one cached FP8 copy of each linear weight for the
    forward and one transposed)."""

    def __init__(
        self,
        shape: ModelShape,
        schedule: Schedule,
        *,
        tokens: int,
        tensor_parallel: int = 1,
        sequence_parallel: bool = False,
        expert_parallel: int = 1,
        data_parallel: int = 1,
        bf16: bool = True,
        optimizer: str = "adam",
        distributed_optimizer: bool = False,
        settings: MemorySettings | None = None,
    ):
        self.shape, self.schedule, self.tokens = shape, schedule, tokens
        self.tp, self.ep, self.dp = tensor_parallel, expert_parallel, data_parallel
        self.replicated_share = 1 / tensor_parallel if sequence_parallel else 1.0
        self.width = 2 if bf16 else 4
        settings = settings or MemorySettings()
        self.recompute = settings.recompute
        self.fp8 = settings.fp8 is not None
        self.bf16, self.optimizer, self.distributed = bf16, optimizer, distributed_optimizer
        self.peaks = PhasePeaks(schedule)
        self._layers = [decoder_layer_memory(shape, i) for i in range(shape.num_layers)]
        self._stages: dict[tuple[str, int], StageMemory] = {}

    @classmethod
    def for_setup(
        cls, shape: ModelShape, setup: Any, schedule: Schedule, settings: MemorySettings
    ) -> MemoryModel:
        """The model of a config: ``setup`` is the advisor's ``ParallelSetup`` (sizes,
        precision, optimizer), micro-batches of ``micro_batch_size`` sequences."""
        return cls(
            shape,
            schedule,
            tokens=setup.micro_batch_size * shape.seq_length,
            tensor_parallel=setup.tensor_model_parallel_size,
            sequence_parallel=setup.sequence_parallel,
            expert_parallel=setup.expert_model_parallel_size,
            data_parallel=setup.data_parallel_size,
            bf16=setup.bf16,
            optimizer=setup.optimizer,
            distributed_optimizer=setup.use_distributed_optimizer,
            settings=settings,
        )

    def _bytes(self, held: Iterable[Held], drop: Collection[str] = ()) -> float:
        """Bytes per token of ``held`` without the modules in ``drop``."""
        kinds = {"act": self.width, "lin": 1 if self.fp8 else self.width, "fp32": 4}
        kinds["grad"] = kinds["lin"]
        return sum(
            kinds[t.kind] * t.elements * (1 / self.tp if t.sharded else self.replicated_share)
            for t in held
            if t.module not in drop
        )

    # -- stages ---------------------------------------------------------------------------
    def stage(self, stage: str, first_layer: int) -> StageMemory:
        """One stage of the layout whose first decoder layer is ``first_layer`` (cached)."""
        key = (stage, first_layer)
        found = self._stages.get(key)
        if found is None:
            found = self._stages[key] = self._stage(stage, first_layer)
        return found

    def _stage(self, stage: str, first_layer: int) -> StageMemory:
        s = self.shape
        h, v = s.hidden_size, s.vocab_size
        norm = 1 if s.normalization == "RMSNorm" else 2
        recomputed, kept_inputs = self.recompute.full_layers(stage.count(DECODER))
        dense = replicated = expert = linear = saved = held = rebuilt = 0.0
        layer, decoder_index = first_layer, 0
        for part in stage:
            if part in (DECODER, MTP):
                memory = self._layers[min(layer, s.num_layers - 1)]
                full = self._bytes(memory.saved)
                _, d_params, e_params, *_ = s.decoder_layer(layer)
                dense, expert = dense + d_params, expert + e_params
                linear += d_params - _non_linear_params(s, layer)
                replicated += _replicated_params(s, layer)
                held += self._bytes(memory.for_w)
                if part == DECODER and decoder_index < recomputed:
                    rebuilt = max(rebuilt, full)
                else:
                    drop = _dropped(self.recompute, s.is_moe(layer)) if part == DECODER else ()
                    kept = self._bytes(memory.saved, drop)
                    saved += kept
                    rebuilt = max(rebuilt, full - kept)
                if part == DECODER:
                    if s.mtp_layers and layer == s.num_layers - 1:
                        # With MTP, Megatron puts the final norm with the last decoder layer
                        # (TransformerBlock.has_final_layernorm_in_this_stage).
                        dense, replicated = dense + norm * h, replicated + norm * h
                    layer, decoder_index = layer + 1, decoder_index + 1
                else:  # the MTP block: its two norms' inputs and outputs, and eh_proj
                    dense += 2 * h * h + 3 * norm * h
                    replicated += 3 * norm * h
                    linear += 2 * h * h
                    saved += self._bytes([Held(4 * h, False, "act")])
                    held += self._bytes(_linear(2 * h, False, h, False))
            elif part == LOSS:  # per head: the final norm's input and output, fp32 softmax
                heads = 1 + s.mtp_layers
                if not s.mtp_layers:  # the final norm; with MTP, on the last decoder layer's
                    dense += norm * h
                    replicated += norm * h
                saved += heads * self._bytes([Held(2 * h, False, "act"), Held(v, True, "fp32")])
                held += heads * self._bytes([Held(h, False, "act"), Held(v, True, "act")])
        saved += kept_inputs * self._bytes([Held(h, False, "act")])
        embedding = EMBEDDING in stage or MTP in stage
        if embedding and s.position_embedding_type == "learned_absolute":
            # The embedding, or the MTP block's copy of it: whole on every TP rank.
            positions = (s.max_position_embeddings or s.seq_length) * h
            dense, replicated = dense + positions, replicated + positions
        tokens, tp = self.tokens, self.tp
        tied = not s.untie_embeddings_and_output_weights
        return StageMemory(
            dense=(dense - replicated) / tp + replicated,
            expert=expert / (tp * self.ep),
            linear_weights=linear / tp + expert / (tp * self.ep),
            embedding_table=embedding,
            output_table=LOSS in stage and not (tied and embedding),
            saved=saved * tokens,
            held_for_w=held * tokens,
            rebuilt=rebuilt * tokens,
        )

    def stages(self, stages: list[str] | tuple[str, ...]) -> list[StageMemory]:
        out, layer = [], 0
        for stage in stages:
            out.append(self.stage(stage, layer))
            layer += stage.count(DECODER)
        return out

    # -- ranks ----------------------------------------------------------------------------
    def bytes_per_parameter(self, data_parallel: int) -> tuple[float, float, float, float]:
        """Bytes per parameter: weight, gradient, optimizer states with and without the
        distributed optimizer over ``data_parallel`` ranks (Megatron's distributed-optimizer
        accounting: bf16 Adam 6 + 12/d, else 18)."""
        moments = 8 if self.optimizer == "adam" else 4
        states = moments + (4 if self.bf16 else 0)  # Adam's moments, the fp32 master copy
        return float(self.width), 4.0, states / data_parallel, float(states)

    def ranks(self, stages: list[str] | tuple[str, ...]) -> list[RankMemory]:
        """Every rank's :class:`RankMemory`."""
        parts = self.stages(stages)
        table = self.shape.vocab_size * self.shape.hidden_size / self.tp
        peaks = self.peaks([p.saved for p in parts], [p.held_for_w for p in parts])
        dense_bytes = self.bytes_per_parameter(self.dp)
        expert_bytes = self.bytes_per_parameter(max(1, self.dp // self.ep))
        out = []
        for rank, (held, peak) in enumerate(zip(self.peaks.stages, peaks, strict=True)):
            chunks = [parts[s] for s in held]
            dense = sum(c.dense + table * (c.embedding_table + c.output_table) for c in chunks)
            expert = sum(c.expert for c in chunks)
            weight, grad, opt_distributed, opt_plain = (
                dense * d + expert * e for d, e in zip(dense_bytes, expert_bytes, strict=True)
            )
            if self.fp8:  # two FP8 copies (1 byte each) of every linear weight
                weight += 2 * sum(c.linear_weights for c in chunks)
            out.append(
                RankMemory(
                    rank=rank,
                    stages=tuple(held),
                    params=dense + expert,
                    expert_params=expert,
                    weights=weight,
                    gradients=grad,
                    optimizer_distributed=opt_distributed,
                    optimizer_not_distributed=opt_plain,
                    activations=peak,
                    recompute=max((c.rebuilt for c in chunks), default=0.0),
                    distributed=self.distributed,
                )
            )
        return out


def _replicated_params(shape: ModelShape, layer: int) -> float:
    """Of decoder layer ``layer``'s parameters, those every tensor-parallel rank holds
    whole: its two norms and the router (as Megatron-LM's memory formula counts them),
    and the biases of the row-parallel projections (attention output, MLP fc2)."""
    h = shape.hidden_size
    norms = 2 * h * (1 if shape.normalization == "RMSNorm" else 2)
    if shape.add_bias_linear:  # the row-parallel output projections' biases are whole
        norms += h * ((not shape.multi_latent_attention) + (not shape.is_moe(layer)))
    return norms + ((shape.num_experts or 0) * h if shape.is_moe(layer) else 0)


def _non_linear_params(shape: ModelShape, layer: int) -> float:
    """Of decoder layer ``layer``'s parameters, those outside linear layers (norms, the
    query and key norms, the router): no FP8 copy."""
    h = shape.hidden_size
    norms = 2 * h * (1 if shape.normalization == "RMSNorm" else 2)
    norms += shape.qk_norm_params()
    router = (shape.num_experts or 0) * h if shape.is_moe(layer) else 0
    return norms + router
