"""How large a schedule megatron-dualpipe builds: the bound of ``simulate``, the smaller one
of a training step (built on every rank), and the optimiser's.

Generation, the checks and the simulation are linear in the number of actions, about PP x
micro-batches (x chunks / 2 for interleaved-1f1b): PP=1000 x 2000 micro-batches takes about a
minute and 1.5 GB (docs/schedules.md); beyond :data:`MAX_SIZE` the actions alone outgrow
2 GB. ``train`` builds the whole step on every rank, and more of it than ``simulate``
(the executor's checks and communication plan beside the schedule): measured by
``bench/step_build.py`` at about :data:`TRAIN_BYTES_PER_UNIT` and
:data:`TRAIN_SECONDS_PER_UNIT` per PP x micro-batch, so it stops at :data:`MAX_TRAIN_SIZE`
(about 1 GB and half a minute per rank). The optimiser keeps several timed orders of the schedule
at once: about :data:`OPTIMIZE_BYTES_PER_UNIT` per PP x micro-batch, so it stops at
:data:`MAX_OPTIMIZE_SIZE`.
"""

from __future__ import annotations

__all__ = [
    "MAX_OPTIMIZE_SIZE",
    "MAX_SIZE",
    "MAX_TIMELINE_SIZE",
    "MAX_NCCL_CHECK_SIZE",
    "MAX_TRAIN_SIZE",
    "NCCL_CHECK_BYTES_PER_UNIT",
    "OPTIMIZE_BYTES_PER_UNIT",
    "TRAIN_BYTES_PER_UNIT",
    "TRAIN_SECONDS_PER_UNIT",
    "nccl_check_size_problem",
    "optimize_size_problem",
    "schedule_size",
    "size_problem",
    "train_build_estimate",
    "train_size_problem",
]

#: The largest PP x micro-batches (x chunks / 2) built.
MAX_SIZE = 2_000_000
#: The largest size whose every action's times are kept for a timeline (--json, --png,
#: --trace, --grid), and whose generated schedule ``simulate`` checks before simulating it
#: (beyond, the check would add a quarter to the time; the generators are checked for every
#: legal size up to PP=16 by the tests, and the simulation itself still finds deadlocks and
#: lost messages).
MAX_TIMELINE_SIZE = 250_000


def schedule_size(num_ranks: int, num_microbatches: int, chunks: int | None = None) -> int:
    """PP x micro-batches x (chunks per rank / 2, at least 1): the measure of the bounds."""
    return num_ranks * num_microbatches * max(1, (chunks or 2) // 2)


def size_problem(
    num_ranks: int, num_microbatches: int, chunks: int | None = None, *, doing: str
) -> str | None:
    """Why a schedule of this size is not built (a clause: the size is too large ``doing``,
    and the bound), or None."""
    if schedule_size(num_ranks, num_microbatches, chunks) <= MAX_SIZE:
        return None
    return (
        f"PP={num_ranks} x {num_microbatches} micro-batches is too large {doing}: PP x "
        f"micro-batches must be at most {MAX_SIZE:,} (PP=1000 x 2000 takes about a minute and "
        "1.5 GB)"
    )


#: What the optimiser holds per PP x micro-batch (x chunks / 2): measured 3.2 KB (dualpipe),
#: 4.8 KB (zb1p) and 6.2-6.8 KB (dualpipev) at PP=20 to 500, peak resident memory.
OPTIMIZE_BYTES_PER_UNIT = 7 * 1024
#: The largest PP x micro-batches optimised: about 2 GB.
MAX_OPTIMIZE_SIZE = 300_000


def optimize_size_problem(
    num_ranks: int, num_microbatches: int, chunks: int | None = None
) -> str | None:
    """Why the optimiser does not take a schedule of this size (a clause with its memory
    estimate and the bound), or None."""
    size = schedule_size(num_ranks, num_microbatches, chunks)
    if size <= MAX_OPTIMIZE_SIZE:
        return None
    need = size * OPTIMIZE_BYTES_PER_UNIT / 2**30
    return (
        f"optimising PP={num_ranks} x {num_microbatches} micro-batches would take about "
        f"{need:.1f} GB (about 7 KB per PP x micro-batch): the optimiser takes PP x "
        f"micro-batches up to {MAX_OPTIMIZE_SIZE:,} (about 2 GB)"
    )


#: What building one training step costs a rank per PP x micro-batch (x chunks / 2): the
#: schedule's generation, the executor's validation and dW-order check, its communication
#: plan. ``bench/step_build.py``, peak resident memory: 3.1 KB (dualpipev, PP=2, 2,000 to
#: 128,000 micro-batches), 2.2 KB (1f1b, PP=4); time 30-95 us, growing with the size, on a
#: shared 2-core machine (128,000 micro-batches of dualpipev at PP=2: 23 s and 770 MB).
TRAIN_BYTES_PER_UNIT = 3200
TRAIN_SECONDS_PER_UNIT = 100e-6
#: The largest PP x micro-batches (x chunks / 2) a training step is built for: about 1 GB
#: and 30 s on each rank.
MAX_TRAIN_SIZE = 300_000


def train_build_estimate(
    num_ranks: int, num_microbatches: int, chunks: int | None = None
) -> tuple[float, float]:
    """About how long (seconds) and how much memory (bytes) building one training step of
    this size takes each rank, from the measured costs above."""
    size = schedule_size(num_ranks, num_microbatches, chunks)
    return size * TRAIN_SECONDS_PER_UNIT, size * TRAIN_BYTES_PER_UNIT


def train_size_problem(
    num_ranks: int, num_microbatches: int, chunks: int | None = None
) -> str | None:
    """Why ``train`` does not build a step of this size (a clause: the size, its estimated
    cost per rank and the bound), or None."""
    if schedule_size(num_ranks, num_microbatches, chunks) <= MAX_TRAIN_SIZE:
        return None
    seconds, need = train_build_estimate(num_ranks, num_microbatches, chunks)
    return (
        f"PP={num_ranks} x {num_microbatches} micro-batches is too large a step to build on "
        f"each rank (about {need / 2**30:.1f} GB and {seconds:.0f} s before the first step, at "
        "3.2 KB and 0.1 ms per PP x micro-batch): train builds PP x micro-batches up to "
        f"{MAX_TRAIN_SIZE:,} (about 1 GB and 30 s)"
    )


#: What ``simulate --check-nccl`` adds per PP x micro-batch (x chunks / 2): the plan and
#: NCCL's stream model of every rank, peak resident memory; dualpipev at PP=50 x 200 and
#: PP=100 x 400: 12.7 and 12.8 KB, 2.6 and 11.9 s (about 0.3 ms per unit, on a shared
#: 2-core machine; PP=200 x 1000 took 127 s and 2.8 GB).
NCCL_CHECK_BYTES_PER_UNIT = 13 * 1024
#: The largest PP x micro-batches checked under NCCL's rules: about 1.2 GB and 30-60 s.
MAX_NCCL_CHECK_SIZE = 100_000


def nccl_check_size_problem(
    num_ranks: int, num_microbatches: int, chunks: int | None = None
) -> str | None:
    """Why ``--check-nccl`` does not take a schedule of this size (a clause with its memory
    estimate and the bound), or None."""
    size = schedule_size(num_ranks, num_microbatches, chunks)
    if size <= MAX_NCCL_CHECK_SIZE:
        return None
    need = size * NCCL_CHECK_BYTES_PER_UNIT / 2**30
    return (
        f"checking PP={num_ranks} x {num_microbatches} micro-batches under NCCL's rules would "
        f"take about {need:.1f} GB and {size * 0.3e-3:.0f} s (about 13 KB and 0.3 ms per PP x "
        f"micro-batch): --check-nccl takes PP x micro-batches up to {MAX_NCCL_CHECK_SIZE:,} "
        "(about 1.2 GB)"
    )
