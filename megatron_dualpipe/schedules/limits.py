"""How large a schedule megatron-dualpipe builds: the bound ``simulate`` and ``train`` share.

Generation, the checks and the simulation are linear in the number of actions, about PP x
micro-batches (x chunks / 2 for interleaved-1f1b): PP=1000 x 2000 micro-batches takes about a
minute and 1.5 GB (docs/schedules.md); beyond :data:`MAX_SIZE` the actions alone outgrow
2 GB. ``train`` builds the whole schedule on every rank, so the same bound applies there.
"""

from __future__ import annotations

__all__ = ["MAX_SIZE", "MAX_TIMELINE_SIZE", "schedule_size", "size_problem"]

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
