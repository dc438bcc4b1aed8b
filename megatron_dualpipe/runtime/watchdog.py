"""Turn a pipeline hang into an error that names the rank, the action and the peer.

Every wait of the executor goes through :meth:`Watchdog.wait` with a deadline. How the
other ranks fail too: a gloo wait that times out closes its connection to that peer, so
the peer's own pending operations fail at once; a rank whose peer exits (after raising)
sees its connection closed; and a rank that waits on a rank that is itself stuck hits
its own deadline. Each of those surfaces here as a :class:`PipelineWaitError`, so within
about one timeout every rank that waits has failed with a message saying what it waited on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Protocol

from ..errors import DualPipeError

__all__ = ["DEFAULT_TIMEOUT_S", "PipelineWaitError", "Watchdog"]

#: How long any pipeline wait (a message, a mirror exchange) may take by default: the
#: default of Megatron-LM's ``--distributed-timeout-minutes`` (10 minutes).
DEFAULT_TIMEOUT_S = 600.0


class _Waitable(Protocol):
    def wait(self, timeout: timedelta = ...) -> object: ...


class PipelineWaitError(DualPipeError, RuntimeError):
    """A pipeline wait failed (timed out, or its peer went away)."""

    def __init__(self, rank: int, what: str, peer: int, elapsed_s: float, cause: str):
        self.rank = rank
        self.what = what
        self.peer = peer
        self.elapsed_s = elapsed_s
        super().__init__(
            f"pipeline rank {rank} gave up on {what} (peer: rank {peer}) after "
            f"{elapsed_s:.1f} s: {cause}"
        )


class Watchdog:
    """Waits with a deadline on behalf of pipeline rank ``rank``."""

    def __init__(self, rank: int, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"the pipeline timeout must be positive, got {timeout_s}")
        self.rank = rank
        self.timeout_s = timeout_s

    @contextmanager
    def guard(self, what: str, peer: int, *, bounded: bool = False) -> Iterator[None]:
        """Turn a communication error raised in the block (about ``what``, exchanged with
        rank ``peer``) into a :class:`PipelineWaitError`; ``bounded``: the block waited
        with this watchdog's timeout."""
        start = time.monotonic()
        try:
            yield
        except RuntimeError as error:
            elapsed = time.monotonic() - start
            text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            if bounded and elapsed >= self.timeout_s * 0.99:
                cause = f"no progress within the {self.timeout_s:g} s timeout ({text})"
            else:
                cause = f"the connection failed, the peer has probably died ({text})"
            raise PipelineWaitError(self.rank, what, peer, elapsed, cause) from error

    def wait(self, work: _Waitable, what: str, peer: int, *, bounded: bool = True) -> None:
        """Wait for ``work`` (a message ``what`` exchanged with rank ``peer``).

        Raises :class:`PipelineWaitError` when it fails (e.g. the peer's process died) or,
        if ``bounded``, does not complete within the timeout. Unbounded waits (for sends,
        which may rightly wait long for a busy receiver) end at the process group's own
        timeout.
        """
        with self.guard(what, peer, bounded=bounded):
            if bounded:
                work.wait(timedelta(seconds=self.timeout_s))
            else:
                work.wait()
