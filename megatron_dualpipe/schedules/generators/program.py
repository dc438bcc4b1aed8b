"""A builder for one rank's compute order, used by the generators."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from functools import partial

from ..ir import Action, Kind, Placement, ScheduleError

# Actions built without NamedTuple's Python-level __new__: generators make ~10^7 of them at
# PP=1000, so each method below builds its actions inline, without helper calls.
_new_action = partial(tuple.__new__, Action)


class RankProgram:
    """Appends one rank's compute actions as an algorithm issues them.

    Each chunk keeps a queue of the micro-batches it will forward and, separately, of those
    it will backward, so generators can say "forward chunk 0" the way the papers do. A
    backward issued with ``split=True`` becomes a B (dX) whose W is queued first-in
    first-out, exactly like a weight-gradient store; ``weight()`` issues the oldest one.
    """

    def __init__(self, placement: Placement, rank: int, microbatches: list[Iterable[int]]):
        self.placement = placement
        self.rank = rank
        self.actions: list[Action] = []
        self._to_forward = [deque(mbs) for mbs in microbatches]
        self._to_backward = [deque(q) for q in self._to_forward]
        self._deferred_w: deque[Action] = deque()
        self._stages = [placement.stage_of(rank, c) for c in range(len(microbatches))]

    def _none_left(self, chunk: int, what: str) -> ScheduleError:
        return ScheduleError(f"rank {self.rank}: no micro-batch left to {what} on chunk {chunk}")

    def _make_forward(self, chunk: int) -> Action:
        queue = self._to_forward[chunk]
        if not queue:
            raise self._none_left(chunk, "forward")
        return _new_action((Kind.F, self._stages[chunk], queue.popleft(), chunk, ()))

    def _make_backward(self, chunk: int, split: bool) -> Action:
        queue = self._to_backward[chunk]
        if not queue:
            raise self._none_left(chunk, "backward")
        stage, mb = self._stages[chunk], queue.popleft()
        if not split:
            return _new_action((Kind.BW, stage, mb, chunk, ()))
        self._deferred_w.append(_new_action((Kind.W, stage, mb, chunk, ())))
        return _new_action((Kind.B, stage, mb, chunk, ()))

    def forward(self, chunk: int = 0) -> None:
        """Forward the chunk's next micro-batch."""
        self.actions.append(self._make_forward(chunk))

    def backward(self, chunk: int = 0, *, split: bool = False) -> None:
        """Backward the chunk's oldest forwarded micro-batch (dX only if ``split``)."""
        self.actions.append(self._make_backward(chunk, split))

    def weight(self) -> None:
        """Run the oldest deferred weight-gradient pass."""
        if not self._deferred_w:
            raise ScheduleError(f"rank {self.rank} has no deferred W to run")
        self.actions.append(self._deferred_w.popleft())

    def forward_backward(self, forward_chunk: int, backward_chunk: int) -> None:
        """Forward one chunk and fully backward another, issued together to overlap."""
        forward = self._make_forward(forward_chunk)
        pair = (forward, self._make_backward(backward_chunk, False))
        self.actions.append(_new_action((Kind.FB, forward[1], forward[2], forward_chunk, pair)))

    @property
    def deferred(self) -> int:
        return len(self._deferred_w)
