"""The schedule registry: one :class:`ScheduleSpec` per pipeline schedule.

Every fact about a schedule that another layer needs (its placement, how many model
chunks a rank holds, which parameters are legal, how many micro-batches it needs at
least, how much parameter memory it costs, who runs it) is stated here once and asked
for everywhere else: the config checks, the placement hook, the Megatron-LM route, the
CLI, the benchmark and the tests. A new schedule is its generator plus one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from .generators.dualpipe import dualpipe, dualpipev
from .generators.interleaved import interleaved_1f1b
from .generators.one_f_one_b import one_f_one_b
from .generators.zb1p import zb1p
from .ir import Schedule, ScheduleError

__all__ = [
    "OUR_SCHEDULES",
    "SCHEDULES",
    "Runner",
    "ScheduleSpec",
    "generate",
    "spec",
]


class Runner(str, Enum):
    """Who executes a schedule's forward-backward step."""

    MEGATRON = "megatron"  # Megatron-Core's own forward-backward functions
    OURS = "megatron-dualpipe"  # this project's runtime executor


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule is and what it accepts.

    ``chunks`` is the number of model chunks (stages) per rank, or None where the virtual
    pipeline size sets it. Micro-batch rules: at least ``min_microbatches_per_rank x PP``
    (and at least 1), a multiple of PP where ``microbatches_multiple_of_pp``, even where
    ``even_microbatches``.
    """

    name: str
    summary: str
    placement: str
    generator: Callable[..., Schedule]
    runner: Runner
    chunks: int | None = 1
    min_ranks: int = 1
    even_ranks: bool = False
    min_microbatches_per_rank: int = 0
    microbatches_multiple_of_pp: bool = False
    even_microbatches: bool = False
    #: Its backward runs as B (dX) and a deferred W (dW): layers must defer their dW.
    splits_backward: bool = False

    @property
    def runs_ours(self) -> bool:
        """Whether this project's runtime runs it (else Megatron-Core's own function)."""
        return self.runner is Runner.OURS

    @property
    def places_chunks(self) -> bool:
        """Whether the schedule, not Megatron's virtual pipeline, decides where the
        model chunks live (the V and the mirror placements)."""
        return self.placement in ("v", "mirror")

    @property
    def param_factor(self) -> float:
        """Parameters held per rank, relative to an even 1/PP share of the model."""
        return 2.0 if self.placement == "mirror" else 1.0

    def chunks_per_rank(self, virtual_pipeline_size: int | None = None) -> int:
        """Model chunks each rank holds (``virtual_pipeline_size`` where it decides)."""
        if self.chunks is not None:
            return self.chunks
        return virtual_pipeline_size or 2

    def model_stages(self, pp: int, virtual_pipeline_size: int | None = None) -> int:
        """How many distinct parts the model's layers are cut into (a mirror placement
        holds every part twice)."""
        stages = pp * self.chunks_per_rank(virtual_pipeline_size)
        return stages // 2 if self.placement == "mirror" else stages

    def min_microbatches(self, pp: int) -> int:
        """The fewest micro-batches the schedule accepts at ``pp`` ranks."""
        least = max(1, self.min_microbatches_per_rank * pp)
        if self.microbatches_multiple_of_pp:
            least = max(least, pp)
        if self.even_microbatches and least % 2:
            least += 1
        return least

    def problem(self, pp: int, microbatches: int) -> str | None:
        """Why (``pp``, ``microbatches``) cannot run, in one sentence, or None."""
        if pp < self.min_ranks:
            return f"{self.name} needs at least {self.min_ranks} pipeline ranks, got {pp}"
        if self.even_ranks and pp % 2:
            return (
                f"{self.name} needs an even number of pipeline ranks, got {pp}: use an even "
                "PP or dualpipev"
            )
        if microbatches < 1:
            return f"{self.name} needs at least one micro-batch, got {microbatches}"
        rules = []
        if self.min_microbatches_per_rank:
            rules.append(f">= {self.min_microbatches_per_rank} x PP = {self.min_microbatches(pp)}")
        if self.microbatches_multiple_of_pp:
            rules.append(f"a multiple of PP = {pp}")
        if self.even_microbatches:
            rules.append("even")
        legal = (
            microbatches >= self.min_microbatches_per_rank * pp
            and not (self.microbatches_multiple_of_pp and microbatches % pp)
            and not (self.even_microbatches and microbatches % 2)
        )
        if legal:
            return None
        return (
            f"{self.name} needs the micro-batches to be {' and '.join(rules)}, got {microbatches}"
        )

    def is_legal(self, pp: int, microbatches: int) -> bool:
        """Whether :meth:`problem` finds nothing."""
        return self.problem(pp, microbatches) is None

    def generate(self, pp: int, microbatches: int, **options: int) -> Schedule:
        """The compute-only schedule for ``pp`` ranks and ``microbatches``; raises
        :class:`ScheduleError` with :meth:`problem`'s sentence when illegal."""
        problem = self.problem(pp, microbatches)
        if problem is not None:
            raise ScheduleError(problem)
        return self.generator(pp, microbatches, **options)


SCHEDULES: dict[str, ScheduleSpec] = {
    s.name: s
    for s in (
        ScheduleSpec(
            name="1f1b",
            summary="Megatron's 1F1B (one forward, one backward), one chunk per rank",
            placement="loop",
            generator=one_f_one_b,
            runner=Runner.MEGATRON,
        ),
        ScheduleSpec(
            name="interleaved-1f1b",
            summary="Megatron's interleaved 1F1B over virtual pipeline stages",
            placement="loop",
            generator=interleaved_1f1b,
            runner=Runner.MEGATRON,
            chunks=None,
            min_ranks=2,
            microbatches_multiple_of_pp=True,
        ),
        ScheduleSpec(
            name="zb1p",
            summary="zero-bubble 1F1B (ZB-H1): dX sent at once, dW deferred",
            placement="loop",
            generator=zb1p,
            runner=Runner.OURS,
            min_ranks=2,
            splits_backward=True,
        ),
        ScheduleSpec(
            name="dualpipe",
            summary="DualPipe: two model copies, data entering at both ends (even PP)",
            placement="mirror",
            generator=dualpipe,
            runner=Runner.OURS,
            chunks=2,
            min_ranks=2,
            even_ranks=True,
            min_microbatches_per_rank=2,
            even_microbatches=True,
            splits_backward=True,
        ),
        ScheduleSpec(
            name="dualpipev",
            summary="DualPipeV: the model cut into 2 x PP stages in a V; loss on rank 0",
            placement="v",
            generator=dualpipev,
            runner=Runner.OURS,
            chunks=2,
            min_ranks=2,
            min_microbatches_per_rank=2,
            splits_backward=True,
        ),
    )
}

#: Schedules this project's runtime runs.
OUR_SCHEDULES = tuple(n for n, s in SCHEDULES.items() if s.runs_ours)


def spec(name: str) -> ScheduleSpec:
    """The spec of schedule ``name``; :class:`ScheduleError` naming the choices if unknown."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(
            f"unknown pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)}"
        ) from None


def generate(name: str, num_ranks: int, num_microbatches: int, **options: int) -> Schedule:
    """Build schedule ``name`` for ``num_ranks`` ranks and ``num_microbatches`` micro-batches."""
    return spec(name).generate(num_ranks, num_microbatches, **options)
