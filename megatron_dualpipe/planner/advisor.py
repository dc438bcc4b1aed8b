"""The balance advisor: which decoder layers each pipeline stage should hold.

From a config's model shape it derives each stage's F, B and W (:mod:`.model_cost`), runs
the schedule through the simulator with those per-stage costs, and searches the split
settings Megatron-LM offers (first/last stage layer counts, embedding/loss accounting,
and a full ``pipeline_model_parallel_layout``) for the shortest simulated step whose
per-rank memory stays within a cap (default: the peak of the config's own split). It
searches with the simulator (a pruned local search), not with a solver. See
docs/advisor.md.
"""

from __future__ import annotations

import heapq
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import yaml

from ..schedules.config_values import check_positive, read_fields
from ..schedules.cost import CostModel
from ..schedules.ir import Kind, Schedule, ScheduleError
from ..schedules.layer_split import (
    LayerSplit,
    stage_layer_counts,
    stage_layouts,
    stages_from_counts,
)
from ..schedules.layout import DECODER, EMBEDDING, LOSS, MTP, format_layout
from ..schedules.registry import spec
from ..schedules.simulate import SimResult, simulate
from .memory import MemoryModel, MemorySettings, RankMemory
from .model_cost import ModelShape, StageCost, Work, stage_costs
from .retime import Retimer

__all__ = [
    "SPLIT_KEYS",
    "Advice",
    "Candidate",
    "ParallelSetup",
    "StageTiming",
    "advise",
    "config_split_lines",
    "even_counts",
    "split_changes",
    "stages_for",
    "yaml_lines",
]

#: The config keys a split is made of (Megatron-LM's flags in snake_case).
SPLIT_KEYS = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "pipeline_model_parallel_layout",
)
GIB = 2**30
#: A full layout is proposed over Megatron's first/last counts only if its simulated step
#: is shorter by more than this share (the FLOP model is not finer than that).
SIMPLER_BY = 0.005
#: How many splits the search toward the memory cap expands where no single move helps.
FIT_EXPANSIONS = 64


def _gib(nbytes: float) -> str:
    """Bytes in GiB as a sentence gives them: a tenth, or two digits below one."""
    gib = nbytes / GIB
    return f"{gib:.1f}" if gib >= 0.1 else f"{gib:.2g}"


@dataclass(frozen=True)
class ParallelSetup:
    """The parallel and training settings that decide per-rank costs and memory, and the
    config's split settings (Megatron-LM's keys and defaults)."""

    micro_batch_size: int
    global_batch_size: int
    pipeline_schedule: str = "1f1b"
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    expert_model_parallel_size: int = 1
    world_size: int | None = None
    bf16: bool = False
    optimizer: str = "adam"
    use_distributed_optimizer: bool = False
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: str | None = None

    def __post_init__(self) -> None:
        check_positive(
            self,
            (
                "micro_batch_size",
                "global_batch_size",
                "pipeline_model_parallel_size",
                "tensor_model_parallel_size",
                "expert_model_parallel_size",
            ),
        )
        spec(self.pipeline_schedule)  # names the choices if unknown
        if self.optimizer not in ("adam", "sgd"):
            raise ScheduleError(f"optimizer: {self.optimizer!r} is not one of adam, sgd")
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if self.world % model_parallel:
            raise ScheduleError(
                f"world_size: {self.world} ranks do not split into tensor x pipeline groups of "
                f"{model_parallel}"
            )
        if self.data_parallel_size % self.expert_model_parallel_size:
            raise ScheduleError(
                f"expert_model_parallel_size: {self.expert_model_parallel_size} must divide "
                f"the data-parallel size {self.data_parallel_size}"
            )
        if self.global_batch_size % (self.micro_batch_size * self.data_parallel_size):
            raise ScheduleError(
                f"global_batch_size: {self.global_batch_size} is not divisible by "
                f"micro_batch_size x data-parallel size = {self.micro_batch_size} x "
                f"{self.data_parallel_size}"
            )

    @staticmethod
    def from_values(
        values: dict, source: str, origins: Mapping[str, str] | None = None
    ) -> ParallelSetup:
        """Read the settings from a config's values; :class:`ConfigValueError` naming the key."""
        return read_fields(ParallelSetup, values, source, origins)

    @property
    def world(self) -> int:
        return (
            self.world_size or self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )

    @property
    def data_parallel_size(self) -> int:
        return self.world // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


@dataclass(frozen=True)
class StageTiming:
    """FLOPs made milliseconds, as a profile measured them: each pass's compute per FLOP
    (F, B, W) and the all-to-all's milliseconds per FLOP of a MoE layer's F and of its B
    (a stage's all-to-all is its MoE layers' FLOPs at those rates: dense layers, the
    embedding, the heads and the loss exchange no tokens). The advisor then searches on
    time, not FLOPs, and the simulator costs a pair by its streams
    (:class:`~..schedules.cost.CostModel`'s ``stage_a2a``)."""

    rates: tuple[float, float, float]
    a2a_rates: tuple[float, float] = (0.0, 0.0)

    def timed(self, cost: StageCost) -> StageCost:
        """``cost`` with its work (compute) and its all-to-all in milliseconds."""
        rf, rb, rw = self.rates
        af, ab = self.a2a_rates
        work = Work(cost.f * rf, cost.b * rb, cost.w * rw)
        return replace(cost, work=work, a2a=(cost.moe.f * af, cost.moe.b * ab))

    @staticmethod
    def cost_model(costs: Sequence[StageCost]) -> CostModel:
        """The simulator's costs of stages timed so (:meth:`timed`)."""
        return CostModel(
            stage_costs=tuple((c.f, c.b, c.w) for c in costs),
            stage_a2a=tuple(c.a2a for c in costs),
        )


@dataclass
class Candidate:
    """One split: its stages (layout strings in pipeline order) with their costs, the
    simulated step and each rank's busy time (its actions' times summed, as the simulator's
    ranks have it; in FLOPs of one rank), and each rank's memory
    (parameters with their gradients and optimizer state, plus the peak of saved
    activations, in bytes); in milliseconds where the search was ``timing``'s."""

    stages: tuple[str, ...]
    costs: list[StageCost]
    makespan: float
    busy: list[float]
    memory: list[float]
    timing: StageTiming | None = None

    @property
    def bubble(self) -> float:
        """Idle time over all ranks' time, as :attr:`SimResult.bubble_ratio`."""
        return 1.0 - sum(self.busy) / (self.makespan * len(self.busy)) if self.makespan else 0.0

    @property
    def peak_memory(self) -> float:
        return max(self.memory)

    @property
    def counts(self) -> list[int]:
        return [stage.count(DECODER) for stage in self.stages]

    @property
    def cost_model(self) -> CostModel:
        """The simulator's cost model of this split."""
        if self.timing is not None:
            return self.timing.cost_model(self.costs)
        return CostModel(stage_costs=tuple((c.f, c.b, c.w) for c in self.costs))


@dataclass
class Advice:
    """What the advisor found: the config's split (``before``), the best split Megatron's
    first/last and accounting settings can express (``first_last``; None if none fits),
    the proposal (``after``) and the split keys that give it (``lines``; None: keep the
    config's), the memory cap, and how much was searched."""

    schedule: Schedule
    before: Candidate
    before_label: str
    after: Candidate
    lines: dict[str, object] | None
    first_last: Candidate | None
    memory_cap: float
    memory_cap_given: bool
    config_lines: dict[str, object]
    config_schedule: str
    parts: dict[str, Work]
    splits_considered: int
    simulated: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    memory_model: MemoryModel | None = None

    def rank_memory(self, candidate: Candidate) -> list[RankMemory]:
        """Every rank's memory, part by part, under ``candidate``'s split."""
        assert self.memory_model is not None
        return self.memory_model.ranks(candidate.stages)

    @property
    def gain(self) -> float:
        """Step before over step after (1.25: the proposal is 1.25x as fast)."""
        return self.before.makespan / self.after.makespan if self.after.makespan else 1.0

    def changes(self) -> dict[str, object]:
        """The config keys to set for the proposal: the schedule where it is not the
        config's, the split keys (and the config's other split keys, cleared); empty when
        the config is already the proposal."""
        out: dict[str, object] = {}
        if self.schedule.name != self.config_schedule:
            out["pipeline_schedule"] = self.schedule.name
        if self.lines is not None:
            out.update(split_changes(self.lines, self.config_lines))
        return out

    def paste_lines(self) -> list[str]:
        """:meth:`changes` as YAML lines to paste into the config."""
        return yaml_lines(self.changes())

    def to_json(self) -> dict:
        """The stable ``simulate --config --json`` shape."""
        p = self.schedule.placement

        def split(c: Candidate) -> dict:
            return {
                "layout": format_layout(list(c.stages)),
                "layers_per_stage": c.counts,
                "step": c.makespan,
                "bubble_ratio": c.bubble,
                "memory_per_rank": c.memory,
                "stage_costs": [[x.f, x.b, x.w] for x in c.costs],
                "stage_a2a": [list(x.a2a) for x in c.costs],
            }

        return {
            "schedule": self.schedule.name,
            "pp": p.num_ranks,
            "model_stages": p.num_model_stages,
            "microbatches": p.num_microbatches,
            "before": {"label": self.before_label, **split(self.before)},
            "first_last": None if self.first_last is None else split(self.first_last),
            "after": split(self.after),
            "changes": self.changes(),
            "gain": self.gain,
            "memory_cap": self.memory_cap,
            "seconds": self.seconds,
            "notes": self.notes,
        }

    def simulate(self, candidate: Candidate) -> SimResult:
        """The simulator's full result (timelines, per-rank figures) for ``candidate``."""
        return simulate(self.schedule, candidate.cost_model)


def advise(
    shape: ModelShape,
    setup: ParallelSetup,
    *,
    schedule: str | None = None,
    microbatches: int | None = None,
    memory_cap: float | None = None,
    settings: MemorySettings | None = None,
    progress: Callable[[str], None] | None = None,
    timing: StageTiming | None = None,
    built: Schedule | None = None,
) -> Advice:
    """Search the split of ``shape`` under ``schedule`` (default: the config's) for the
    shortest simulated step within ``memory_cap`` bytes per rank (default: the peak of the
    config's split, or of the most even split where the config's does not load); memory
    per rank as :mod:`.memory` counts it with ``settings`` (FP8, recomputation). Stages
    are timed by their FLOPs, or in milliseconds by ``timing``; ``built`` is another
    schedule of ``schedule``'s placement to time (Megatron's or torch's), in its stead."""
    started = time.perf_counter()
    say = progress or (lambda _line: None)
    found = spec(schedule or setup.pipeline_schedule)
    virtual = found.chunks is None  # Megatron's first/last counts do not apply
    if virtual and built is None:
        raise ScheduleError(
            f"the advisor handles schedules with a fixed number of stages per rank; "
            f"{found.name} reads first/last counts per rank over virtual stages: choose "
            "another --schedule"
        )
    config_schedule = setup.pipeline_schedule
    setup = replace(setup, pipeline_schedule=found.name)
    pp = setup.pipeline_model_parallel_size
    m = microbatches if microbatches is not None else setup.num_microbatches
    # A schedule built elsewhere (Megatron's, torch's) has its own micro-batch rules.
    problem = found.problem(pp, m) if built is None else None
    if problem is not None and microbatches is not None:
        raise ScheduleError(f"{problem}: change --microbatches")
    if problem is not None:
        raise ScheduleError(
            f"{problem}: change global_batch_size, micro_batch_size or "
            f"pipeline_model_parallel_size (micro-batches = global_batch_size / "
            f"(micro_batch_size x data-parallel size)), or give --microbatches"
        )
    settings = settings or MemorySettings()
    timed = built if built is not None else found.generate(pp, m)
    search = _Search(shape, setup, timed, settings, timing)
    notes: list[str] = [] if settings.recompute_granularity is None else [_recompute_note(search)]
    try:
        before_stages = search.config_stages()
        label = "config's split" if _has_split(setup) else "even split"
        loads = True
    except ScheduleError as err:
        before_stages = search.stages_from_counts(even_counts(shape.num_layers, search.stages))
        label, loads = "most even split", False
        notes.append(f"the config's split does not load ({err}); compared with the most even")
    before = search.evaluate(before_stages)
    cap = memory_cap if memory_cap is not None else before.peak_memory
    say(f"before: step {before.makespan:.4g}, searching Megatron's first/last settings")
    first_last, first_last_lines = (None, {}) if virtual else search.best_first_last(cap, say)
    starts = [c for c in (first_last, before) if c is not None and c.peak_memory <= cap]
    starts.append(search.evaluate(search.stages_from_counts(search.balanced_counts())))
    after = search.local_search(starts, cap, say)
    if after is None:
        leanest = min(search.seen.values(), key=lambda c: c.peak_memory)
        raise ScheduleError(
            f"no split found fits the memory cap of {_gib(cap)} GiB per rank (the leanest "
            f"needs {_gib(leanest.peak_memory)} GiB): raise --memory-cap"
        )
    lines: dict[str, object] | None = _layout_lines(after.stages)
    if first_last is not None and first_last.makespan <= after.makespan * (1 + SIMPLER_BY):
        after, lines = first_last, first_last_lines  # about as fast, and simpler to write
    if after.makespan >= before.makespan and before.peak_memory <= cap:
        after = before
        lines = None if loads else _layout_lines(before.stages)
    return Advice(
        schedule=search.schedule,
        before=before,
        before_label=label,
        after=after,
        lines=lines,
        first_last=first_last,
        memory_cap=cap,
        memory_cap_given=memory_cap is not None,
        config_lines=config_split_lines(setup),
        config_schedule=config_schedule,
        parts=search.parts(),
        splits_considered=search.considered,
        simulated=len(search.seen),
        seconds=time.perf_counter() - started,
        notes=notes,
        memory_model=search.memory_model,
    )


def stages_for(shape: ModelShape, setup: ParallelSetup, model_stages: int) -> list[str]:
    """The config's split as layout strings over ``model_stages`` stages in pipeline order
    (a layout string as given, with the MTP layers in the loss's stage as our schedules
    place them; first/last counts and accounting through
    :func:`.layer_split.stage_layer_counts`); :class:`ScheduleError` with the fix where it
    does not split."""
    split = LayerSplit(
        shape.num_layers,
        setup.decoder_first_pipeline_num_layers,
        setup.decoder_last_pipeline_num_layers,
        setup.account_for_embedding_in_pipeline_split,
        setup.account_for_loss_in_pipeline_split,
    )
    layout = setup.pipeline_model_parallel_layout
    return stage_layouts(split, model_stages, layout, shape.mtp_layers)


# --------------------------------------------------------------------------------------
# The search.


class _Search:
    """Evaluates splits of one model under one generated schedule (memoised), and searches."""

    def __init__(
        self,
        shape: ModelShape,
        setup: ParallelSetup,
        schedule: Schedule,
        settings: MemorySettings,
        timing: StageTiming | None,
    ):
        self.shape, self.setup, self.schedule = shape, setup, schedule
        self.settings, self.timing = settings, timing
        self.splits_backward = any(a.kind is Kind.W for acts in schedule.ranks for a in acts)
        p = schedule.placement
        self.placement = p
        self.stages = p.num_model_stages
        self.tokens = setup.micro_batch_size * shape.seq_length
        self.seen: dict[tuple[str, ...], Candidate] = {}
        self.considered = 0
        self._stage_cache: dict[tuple[str, int], StageCost] = {}
        self._memory: dict[tuple[str, ...], list[float]] = {}
        self.memory_model = MemoryModel.for_setup(shape, setup, schedule, settings)
        #: The model stages each rank holds, and how many micro-batches pass each stage.
        self.rank_stages = self.memory_model.peaks.stages
        self.passes = sum(0 in p.path(m) for m in range(p.num_microbatches))
        #: The stages each rank holds; each stage's upstream stage and that one's model stage.
        self.held = [[p.stage_of(r, c) for c in range(p.num_chunks)] for r in range(p.num_ranks)]
        self.prev = [
            (q, None if q is None else p.model_stage(q))
            for q in map(p.prev_stage, range(p.num_stages))
        ]
        self.retimer = Retimer(schedule)

    # -- splits ---------------------------------------------------------------------------
    def config_stages(self) -> tuple[str, ...]:
        return tuple(stages_for(self.shape, self.setup, self.stages))

    def stages_from_counts(self, counts: list[int]) -> tuple[str, ...]:
        return tuple(stages_from_counts(counts, self.shape.mtp_layers))

    def balanced_counts(self) -> list[int]:
        """Counts that spread the work evenly over ranks (each layer to the rank, then the
        stage, with the least work so far), a start for the local search."""
        counts = [0] * self.stages
        load = [c.work.total for c in self.costs(self.stages_from_counts(counts))]
        n = self.shape.num_layers
        per_layer = sum(self._cost(DECODER, i).work.total for i in range(n)) / n
        for _ in range(n):
            rank = min(
                range(self.placement.num_ranks),
                key=lambda r: (sum(load[s] for s in self.rank_stages[r]), r),
            )
            stage = min(self.rank_stages[rank], key=lambda s: (load[s], s))
            counts[stage] += 1
            load[stage] += per_layer
        return counts

    def first_last_splits(self) -> Iterator[tuple[dict[str, object], tuple[str, ...]]]:
        """Every split Megatron's first/last counts and accounting settings express here."""
        n, mtp = self.shape.num_layers, self.shape.mtp_layers
        options: list[dict[str, object]] = [{}]
        options += [
            {"account_for_embedding_in_pipeline_split": e, "account_for_loss_in_pipeline_split": lo}
            for e, lo in ((True, False), (False, True), (True, True))
        ]
        ends = [None, *range(1, n + 1)]
        options += [
            {"decoder_first_pipeline_num_layers": f, "decoder_last_pipeline_num_layers": la}
            for f in ends
            for la in ends
            if f is not None or la is not None
        ]
        for option in options:
            split = LayerSplit(
                n,
                option.get("decoder_first_pipeline_num_layers"),
                option.get("decoder_last_pipeline_num_layers"),
                bool(option.get("account_for_embedding_in_pipeline_split")),
                bool(option.get("account_for_loss_in_pipeline_split")),
            )
            try:
                counts = stage_layer_counts(split, self.stages)
            except ScheduleError:
                continue
            yield option, tuple(stages_from_counts(counts, mtp))

    def best_first_last(
        self, cap: float, say: Callable[[str], None]
    ) -> tuple[Candidate | None, dict[str, object]]:
        """The fastest split within ``cap`` that Megatron's first/last counts or
        accounting settings express, and its config keys (None, {} if none fits)."""
        splits = list(self.first_last_splits())
        ranked = sorted(splits, key=lambda item: self.lower_bound(item[1]))
        best: Candidate | None = None
        lines: dict[str, object] = {}
        for i, (option, stages) in enumerate(ranked):
            self.considered += 1
            if best is not None and self.lower_bound(stages) >= best.makespan:
                break  # sorted: no later split can be faster
            if max(self.memory(stages)) > cap:
                continue
            cand = self.evaluate(stages)
            if best is None or cand.makespan < best.makespan:
                best, lines = cand, _first_last_lines(option)
            say(f"first/last settings: {i + 1} of {len(ranked)}, best step {best.makespan:.4g}")
        return best, lines

    def local_search(
        self, starts: list[Candidate], cap: float, say: Callable[[str], None]
    ) -> Candidate | None:
        """From each start, move one layer at a time between stages while the simulated
        step shrinks (moves tried in order of their lower bound, which prunes the rest); a
        start over ``cap`` first moves layers while that lowers its peak memory, and where no
        single move does, searches a few moves further (:meth:`_fit`)."""
        best: Candidate | None = None
        for start in starts:
            current = start
            while True:
                self.considered += 1
                moved = self._improve(current, cap)
                if moved is None and current.peak_memory > cap:
                    moved = self._fit(current, cap)
                if moved is None:
                    break
                current = moved
                say(
                    f"layout search: {len(self.seen)} splits simulated, step "
                    f"{current.makespan:.4g} ({current.makespan / starts[0].makespan - 1:+.1%})"
                )
            if current.peak_memory <= cap and (best is None or current.makespan < best.makespan):
                best = current
        return best

    def _moves(self, counts: list[int]) -> Iterator[tuple[str, ...]]:
        """The splits one layer away from ``counts``."""
        for i in range(self.stages):
            if not counts[i]:
                continue
            for j in range(self.stages):
                if i != j:
                    new = list(counts)
                    new[i] -= 1
                    new[j] += 1
                    yield self.stages_from_counts(new)

    def _fit(self, current: Candidate, cap: float) -> Candidate | None:
        """A split within ``cap`` a few moves from ``current``, which no single move brings
        closer to it: a best-first search on the memory over the cap (:meth:`_over`),
        through splits not seen before, of at most :data:`FIT_EXPANSIONS` splits."""
        start = current.stages
        queue = [(self._over(current.memory, cap), start)]
        visited = {start}
        for _ in range(FIT_EXPANSIONS):
            if not queue:
                return None
            _, stages = heapq.heappop(queue)
            for nxt in self._moves([stage.count(DECODER) for stage in stages]):
                if nxt in visited:
                    continue
                visited.add(nxt)
                memory = self.memory(nxt)
                if max(memory) <= cap:
                    return self.evaluate(nxt)
                heapq.heappush(queue, (self._over(memory, cap), nxt))
        return None

    def _improve(self, current: Candidate, cap: float) -> Candidate | None:
        moves = [(self.lower_bound(stages), stages) for stages in self._moves(current.counts)]
        moves.sort()
        # Over the cap, first toward it: the fastest-looking move that lowers the peak.
        over = current.peak_memory > cap
        for bound, stages in moves:
            self.considered += 1
            if not over and bound >= current.makespan * (1 - 1e-12):
                return None
            peak = max(self.memory(stages))
            if over:
                if peak < current.peak_memory:
                    return self.evaluate(stages)
                continue
            if peak > cap:
                continue
            cand = self.evaluate(stages)
            if cand.makespan < current.makespan * (1 - 1e-12):
                return cand
        return None

    @staticmethod
    def _over(memory: list[float], cap: float) -> tuple[float, float, float]:
        """How far ``memory`` is over ``cap``: the excess summed over ranks, then the peak,
        then the sum (a layer moved to where it weighs less, though no rank fits yet)."""
        return sum(max(0.0, m - cap) for m in memory), max(memory), sum(memory)

    def parts(self) -> dict[str, Work]:
        """The work of each kind of part for one micro-batch on one rank, for the report."""
        n, out = self.shape.num_layers, {}
        for label, moe in (("dense layer", False), ("MoE layer", True)):
            layer = next((i for i in range(n) if self.shape.is_moe(i) == moe), None)
            if layer is not None:
                out[label] = self._cost(DECODER, layer).work
        if self.shape.mtp_layers:
            out["MTP layer"] = self._cost(MTP, n).work
        out["embedding"] = self._cost(EMBEDDING, 0).work
        heads = 1 + self.shape.mtp_layers
        out["output layer and loss" + (f" (x{heads}: MTP)" if heads > 1 else "")] = self._cost(
            LOSS, n
        ).work
        return out

    # -- evaluation -----------------------------------------------------------------------
    def costs(self, stages: tuple[str, ...] | list[str]) -> list[StageCost]:
        """Per-stage costs, cached by (stage, its first decoder layer)."""
        out, layer = [], 0
        for stage in stages:
            out.append(self._cost(stage, layer))
            layer += stage.count(DECODER)
        return out

    def _cost(self, stage: str, first_layer: int) -> StageCost:
        key = (stage, first_layer)
        cost = self._stage_cache.get(key)
        if cost is None:
            cost = self._stage_cache[key] = self._stage_cost(stage, first_layer)
        return cost

    def _stage_cost(self, stage: str, first_layer: int) -> StageCost:
        # Pad with the stages before it so that its layers get their global numbers.
        before = [DECODER * first_layer] if first_layer else []
        s = self.setup
        costs = stage_costs(
            self.shape,
            [*before, stage],
            tokens=self.tokens,
            tensor_parallel=s.tensor_model_parallel_size,
            sequence_parallel=s.sequence_parallel,
            expert_parallel=s.expert_model_parallel_size,
            activation_bytes=2 if s.bf16 else 4,
            # A profile's B already holds whatever the profiled run recomputed.
            recompute=self.settings.recompute if self.timing is None else None,
        )
        return costs[-1] if self.timing is None else self.timing.timed(costs[-1])

    def lower_bound(self, stages: tuple[str, ...]) -> float:
        """No step is shorter: for each rank, its compute time, after the forwards that
        must run before its first (the stages upstream of one it holds), and, where its
        last work is a full backward, before the backwards that must follow it (no pass,
        alone or in a pair, takes less than its compute)."""
        costs = self.costs(stages)
        p = self.placement
        head = [0.0] * p.num_stages  # forward time upstream of each stage
        tail = [0.0] * p.num_stages  # full-backward time upstream of each stage
        for stage, (prev, model) in enumerate(self.prev):
            if prev is not None:
                head[stage] = head[prev] + costs[model].f
                tail[stage] = tail[prev] + costs[model].b + costs[model].w
        if self.splits_backward:
            tail = [0.0] * p.num_stages
        share = self.passes  # no pass, alone or paired, takes less than its compute
        return max(
            min(head[s] for s in held)
            + share * sum(costs[p.model_stage(s)].work.total for s in held)
            + min(tail[s] for s in held)
            for held in self.held
        )

    def memory(self, stages: tuple[str, ...]) -> list[float]:
        """Each rank's bytes (:class:`.memory.MemoryModel`; memoised)."""
        found = self._memory.get(stages)
        if found is None:
            found = self._memory[stages] = [r.total for r in self.memory_model.ranks(stages)]
        return found

    def evaluate(self, stages: tuple[str, ...]) -> Candidate:
        """Time ``stages`` as the simulator does (memoised)."""
        cand = self.seen.get(stages)
        if cand is None:
            costs = self.costs(stages)
            a2a = [c.a2a for c in costs] if self.timing is not None else None
            makespan, busy = self.retimer.timed([(c.f, c.b, c.w) for c in costs], a2a)
            cand = Candidate(stages, costs, makespan, busy, self.memory(stages), self.timing)
            self.seen[stages] = cand
        return cand


def even_counts(num_layers: int, stages: int) -> list[int]:
    """As even as counts go: the extra layers on the stages nearest the middle."""
    base, extra = divmod(num_layers, stages)
    middle = sorted(range(stages), key=lambda s: (abs(2 * s - (stages - 1)), s))[:extra]
    return [base + (s in middle) for s in range(stages)]


def _recompute_note(search: _Search) -> str:
    """What the config's recomputation costs and saves, per decoder layer and micro-batch on
    one rank: B's FLOPs (:func:`.model_cost.stage_costs`) and the saved activations
    (:class:`.memory.MemoryModel`), each with it and without; the simulator charges both."""
    setup, settings = search.setup, search.settings
    layers = DECODER * search.shape.num_layers
    args = dict(
        tokens=search.tokens,
        tensor_parallel=setup.tensor_model_parallel_size,
        sequence_parallel=setup.sequence_parallel,
        expert_parallel=setup.expert_model_parallel_size,
        activation_bytes=2 if setup.bf16 else 4,
    )
    (with_,) = stage_costs(search.shape, [layers], recompute=settings.recompute, **args)
    (without,) = stage_costs(search.shape, [layers], **args)
    plain = replace(
        settings,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        recompute_modules=None,
    )
    plain_memory = MemoryModel.for_setup(search.shape, setup, search.schedule, plain)
    saved = search.memory_model.stage(layers, 0).saved
    saved_plain = plain_memory.stage(layers, 0).saved
    n = search.shape.num_layers
    return (
        f"{settings.recompute.describe()}: B also runs the recomputed forward, "
        f"{(with_.b - without.b) / n:.3g} FLOP more per layer and micro-batch "
        f"(B {without.b / n:.3g} -> {with_.b / n:.3g}); saved activations "
        f"{saved_plain / n / 2**20:.3g} -> {saved / n / 2**20:.3g} MiB per layer and "
        "micro-batch; the simulated steps and memory above include both"
    )


def _has_split(setup: ParallelSetup) -> bool:
    return any(getattr(setup, key) not in (None, False) for key in SPLIT_KEYS)


def config_split_lines(setup: ParallelSetup) -> dict[str, object]:
    """The split keys the config sets (:data:`SPLIT_KEYS`), with their values."""
    return {k: getattr(setup, k) for k in SPLIT_KEYS if getattr(setup, k) not in (None, False)}


def _first_last_lines(option: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in option.items() if v not in (None, False)}


def _layout_lines(stages: tuple[str, ...]) -> dict[str, object]:
    return {"pipeline_model_parallel_layout": format_layout(list(stages))}


def split_changes(proposal: dict[str, object], config: dict[str, object]) -> dict[str, object]:
    """The split keys to set so that a config whose split keys are ``config`` gives
    ``proposal``: the proposal's keys, and the config's other split keys cleared (null, or
    false for the accounting flags)."""
    out: dict[str, object] = {}
    for key in SPLIT_KEYS:
        if key in proposal:
            out[key] = proposal[key]
        elif key in config:
            out[key] = False if key.startswith("account") else None
    return out


def yaml_lines(values: dict[str, object]) -> list[str]:
    """``key: value`` lines in YAML."""
    return [f"{key}: {_yaml(value)}" for key, value in values.items()]


def _yaml(value: object) -> str:
    """``value`` as YAML, quoting a string only where YAML would read it otherwise."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        plain = re.fullmatch(r"[\w.-]+", value) and yaml.safe_load(value) == value
        return value if plain else json.dumps(value)
    return str(value)
