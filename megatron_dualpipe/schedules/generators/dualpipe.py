"""DualPipe and DualPipeV (DeepSeek-V3 report; DualPipeV "cut-in-half" by Sea AI Lab).

Both run the same eight steps on every rank; they differ in placement. In DualPipeV one
model is cut into ``2R`` stages laid out as a V over R ranks. In DualPipe two copies of an
R-stage model run in opposite directions, and the steps are taken relative to the nearer
end of the pipeline. In the steps, chunk 0 is the direction whose data enters nearer to
this rank and chunk 1 the other; ``n`` ranks make one direction's walk to the turn, and
``k`` micro-batches pass through each chunk.
"""

from __future__ import annotations

from ..ir import Placement, Schedule
from .program import RankProgram


def _eight_steps(prog: RankProgram, r: int, n: int, k: int, chunk: tuple[int, int]) -> None:
    """Issue the DualPipe steps for position ``r`` of ``n``; ``chunk`` maps the algorithm's
    chunks 0/1 to this rank's local chunks."""
    c0, c1 = chunk
    at_turn = r == n - 1  # the rank where a micro-batch turns from chunk 0 to chunk 1

    # Step 1: nF0 -- fill the pipeline from this rank's end.
    for _ in range(2 * (n - r - 1)):
        prog.forward(c0)
    # Step 2: nF0F1 -- the other direction's micro-batches arrive; forward both.
    for _ in range(r + 1):
        prog.forward(c0)
        prog.forward(c1)
    # Step 3: nB1W1F1 -- first backwards, zero-bubble: dX now, dW right after.
    for _ in range(n - r - 1):
        prog.backward(c1, split=True)
        prog.weight()
        prog.forward(c1)
    # Step 4 (main): nF0B1F1B0 -- overlapped forward/backward pairs.
    for i in range(k - 2 * n + r + 1):
        if i == 0 and at_turn:
            # At the turn the first pair is not overlapped: it shortens the bubble.
            prog.forward(c0)
            prog.backward(c1)
        else:
            prog.forward_backward(c0, c1)
        prog.forward_backward(c1, c0)
    # Step 5: nB1F1B0 -- forwards run out on chunk 0.
    for _ in range(n - r - 1):
        prog.backward(c1)
        prog.forward_backward(c1, c0)
    # Step 6: nB1B0 -- drain backwards; the second half defer their dW.
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        prog.backward(c1, split=split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        prog.backward(c0, split=split)
    # Step 7: nWB0 -- fill the wait for the last dX with deferred dW.
    for _ in range(n - r - 1):
        prog.weight()
        prog.backward(c0, split=True)
    # Step 8: nW -- the remaining dW.
    for _ in range(r + 1):
        prog.weight()
    if prog.deferred:
        raise AssertionError(f"rank {prog.rank} ended with {prog.deferred} W left")


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV: rank r holds stages r and ``2R-1-r``; loss on rank 0."""
    placement = Placement("v", num_ranks, 2 * num_ranks, num_microbatches)
    ranks = []
    for rank in range(num_ranks):
        prog = RankProgram(placement, rank, [range(num_microbatches)] * 2)
        _eight_steps(prog, rank, num_ranks, num_microbatches, (0, 1))
        ranks.append(prog.actions)
    return Schedule("dualpipev", placement, ranks, [2 * num_ranks + 1] * num_ranks)


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe: two mirrored copies; half the micro-batches enter at rank 0, half at the
    last rank; rank r's steps mirror those of rank ``R-1-r``."""
    placement = Placement("mirror", num_ranks, 2 * num_ranks, num_microbatches)
    half = num_microbatches // 2
    ranks = []
    for rank in range(num_ranks):
        prog = RankProgram(placement, rank, [range(half), range(half, num_microbatches)])
        second_half = rank >= num_ranks // 2
        position = min(rank, num_ranks - 1 - rank)
        chunks = (1, 0) if second_half else (0, 1)
        _eight_steps(prog, position, num_ranks // 2, half, chunks)
        ranks.append(prog.actions)
    return Schedule("dualpipe", placement, ranks, [num_ranks + 1] * num_ranks)
