"""The deferred weight-gradient (dW) store of one pipeline executor.

A B action (dX only) runs its backward while the store *captures*: every layer that can
defer hands its weight-gradient work to the store instead of doing it, and the work
recorded during that one backward becomes one entry. A W action runs the oldest entry of
its lane. Entries are first-in first-out within a lane, the order Transformer Engine's
per-module ``wgrad_store`` also follows; the executor's lanes are its stages (each stage
has its own modules), so the W of different stages may run in any order, but a schedule
whose W of one stage are not in that stage's B order is a bug and fails loudly.

Layers find the store through :func:`active_store`, read during their *forward* (always on
the caller's thread) and kept with the autograd context: the backward may run on another
thread (CUDA autograd), where a context variable would not be visible, but the store
object is. Each executor owns its store; there is no process-wide state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

__all__ = [
    "WeightGradStore",
    "accumulate_grad",
    "active_store",
    "defer_or_run",
    "defers",
    "fire_after",
    "hooks_once",
]

_ACTIVE: ContextVar[WeightGradStore | None] = ContextVar("weight_grad_store", default=None)
#: Inside :func:`hooks_once`: the hooks asked for so far, one per key.
_PENDING_HOOKS: ContextVar[dict[Hashable, Callable[[], None]] | None] = ContextVar(
    "pending_wgrad_hooks", default=None
)


def defers(store: WeightGradStore | None) -> bool:
    """Whether weight-gradient work issued now waits for a W: ``store`` (the one a layer
    kept from its forward) is capturing a B."""
    return store is not None and store.capturing


def defer_or_run(store: WeightGradStore | None, work: Callable[[], None]) -> None:
    """Hand ``work`` to ``store`` while it captures (a B), else run it now (a BW)."""
    if defers(store):
        store.defer(work)
    else:
        work()


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad`` as autograd's accumulation does: assign when there
    is none yet, else add in place."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def fire_after(key: Hashable, fire: Callable[[], None]) -> None:
    """Run ``fire`` (a layer's weight-gradient hooks, which move its ``.grad`` on, e.g. into
    Megatron DDP's ``main_grad``) now, or inside :func:`hooks_once` once when the block
    ends, however often asked under ``key`` (the layer)."""
    pending = _PENDING_HOOKS.get()
    if pending is None:
        fire()
    else:
        pending.setdefault(key, fire)


@contextmanager
def hooks_once() -> Iterator[None]:
    """Within the block (one W's work, or one full backward), :func:`fire_after` collects
    each layer's hooks once; they run, in the order first asked, when the block ends
    without an error. A layer used twice in one micro-batch (the output layer, which the
    MTP block uses too) so gets both dWs summed in its ``.grad`` before its hooks take it,
    as autograd sums them before its accumulation hook fires: the same rounding."""
    pending: dict[Hashable, Callable[[], None]] = {}
    token = _PENDING_HOOKS.set(pending)
    try:
        yield
    finally:
        _PENDING_HOOKS.reset(token)
    for fire in pending.values():
        fire()


def active_store() -> WeightGradStore | None:
    """The store of the forward now running, or None outside any executor's forward.

    Deferrable layers call this in ``forward`` and keep the result for their backward.
    """
    return _ACTIVE.get()


@dataclass
class _Entry:
    key: Hashable
    work: list[Callable[[], None]] = field(default_factory=list)
    owner: object = None


class WeightGradStore:
    """FIFOs (one per lane) of deferred weight-gradient work, one entry per captured
    backward."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, deque[_Entry]] = {}
        self._capturing: _Entry | None = None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Make this the store that layers see (via :func:`active_store`) during a forward."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    @contextmanager
    def capture(self, key: Hashable, owner: object = None, lane: Hashable = None) -> Iterator[None]:
        """Record the work deferred inside the block as one entry named ``key``, queued in
        ``lane`` (one lane for all by default).

        ``owner`` is kept alive as long as the entry (the executor passes the token that
        counts the micro-batch's activations as live). The entry is queued even when no
        layer deferred anything, so every B still pairs with exactly one W. On an
        exception nothing is queued.
        """
        if self._capturing is not None:
            raise RuntimeError(
                f"weight-gradient capture of {key} started inside that of {self._capturing.key}"
            )
        entry = _Entry(key, owner=owner)
        self._capturing = entry
        try:
            yield
        finally:
            self._capturing = None
        self._queues.setdefault(lane, deque()).append(entry)

    @property
    def capturing(self) -> bool:
        """True while a B's backward runs: layers must defer their weight gradients."""
        return self._capturing is not None

    def defer(self, work: Callable[[], None]) -> None:
        """Queue ``work`` (which accumulates weight gradients) into the entry being captured."""
        if self._capturing is None:
            raise RuntimeError("defer() called while no backward is being captured")
        self._capturing.work.append(work)

    def run(self, key: Hashable, lane: Hashable = None) -> None:
        """Run and drop the oldest entry of ``lane``, which must be ``key``'s.

        Its work runs in the order it was recorded; the entry (and what it holds alive) is
        released before this returns.
        """
        queue = self._queues.get(lane)
        if not queue:
            raise RuntimeError(f"W for {key}: no deferred weight gradient is queued")
        oldest = queue[0]
        if oldest.key != key:
            raise RuntimeError(
                f"W for {key} but the oldest deferred weight gradient is {oldest.key}: "
                "W actions must follow their B actions in first-in first-out order"
            )
        entry = queue.popleft()
        with hooks_once():
            for work in entry.work:
                work()

    def __len__(self) -> int:
        """Entries waiting for their W."""
        return sum(len(queue) for queue in self._queues.values())
