"""Interleaved 1F1B (Narayanan et al., 2021), in Megatron-core's order."""

from __future__ import annotations

from ..ir import Action, Kind, Placement, Schedule, ScheduleError


def interleaved_1f1b(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Each rank holds ``chunks`` stages in a loop placement. Work proceeds in groups of
    ``ranks`` micro-batches per chunk: forwards walk the chunks upwards, backwards walk them
    downwards; rank r runs ``2(ranks-r-1) + (chunks-1)ranks`` forwards before its first
    backward, then alternates, then drains."""
    if chunks < 2:
        raise ScheduleError("interleaved-1f1b needs --chunks >= 2 (use 1f1b for one chunk)")
    placement = Placement("loop", num_ranks, num_ranks * chunks, num_microbatches)
    total = num_microbatches * chunks
    group = num_ranks * chunks

    def unit(k: int, backward: bool) -> tuple[int, int]:
        """(chunk, micro-batch) of the k-th forward (or backward) this rank runs."""
        chunk = (k % group) // num_ranks
        return (chunks - 1 - chunk if backward else chunk), (k // group) * num_ranks + k % num_ranks

    def action(kind: Kind, rank: int, k: int) -> Action:
        chunk, mb = unit(k, kind is Kind.BW)
        return Action(kind, placement.stage_of(rank, chunk), mb, chunk)

    ranks = []
    bound = []
    for rank in range(num_ranks):
        if num_microbatches == num_ranks:
            warmup = total
        else:
            warmup = min((num_ranks - rank - 1) * 2 + (chunks - 1) * num_ranks, total)
        acts = [action(Kind.F, rank, k) for k in range(warmup)]
        for k in range(total - warmup):
            acts.append(action(Kind.F, rank, warmup + k))
            acts.append(action(Kind.BW, rank, k))
        acts += [action(Kind.BW, rank, k) for k in range(total - warmup, total)]
        ranks.append(acts)
        bound.append(min(warmup + 1, total))
    return Schedule("interleaved-1f1b", placement, ranks, bound)
