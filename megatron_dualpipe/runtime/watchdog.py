"""Turn a pipeline hang into an error that names the rank, the action and the peer.

Every wait of the executor goes through :meth:`Watchdog.wait` with a deadline. How the
other ranks fail too: a gloo wait that times out closes its connection to that peer, so
the peer's own pending operations fail at once; a rank whose peer exits (after raising)
sees its connection closed; and a rank that waits on a rank that is itself stuck hits
its own deadline. Each of those surfaces here as a :class:`PipelineWaitError`, so within
about one timeout every rank that waits has failed with a message saying what it waited on.

A peer is called dead only when the backend says the connection to it broke. Any other
failure of a send or receive (the backend refusing a tensor, say) belongs to this rank
and raises a :class:`PipelineCommError` that says so.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Protocol

from ..errors import DualPipeError

__all__ = ["DEFAULT_TIMEOUT_S", "PipelineCommError", "PipelineWaitError", "Watchdog"]

#: How long any pipeline wait (a message, a mirror exchange) may take by default: the
#: default of Megatron-LM's ``--distributed-timeout-minutes`` (10 minutes).
DEFAULT_TIMEOUT_S = 600.0

#: Lower-case fragments of the errors backends raise when the connection to a peer broke
#: (gloo: the peer's socket closed or was reset; NCCL: a remote error).
_PEER_LOST = ("connection closed", "connection reset", "broken pipe", "remote process exited")


class _Waitable(Protocol):
    def wait(self, timeout: timedelta = ...) -> object: ...


class PipelineCommError(DualPipeError, RuntimeError):
    """A pipeline send or receive failed on this rank, not because of its peer."""

    def __init__(self, rank: int, what: str, peer: int, cause: str, message: str = ""):
        self.rank = rank
        self.what = what
        self.peer = peer
        super().__init__(
            message or f"pipeline rank {rank} failed on {what} (peer: rank {peer}): {cause}"
        )


class PipelineWaitError(PipelineCommError):
    """A pipeline wait failed: it timed out, or the connection to its peer broke."""

    def __init__(self, rank: int, what: str, peer: int, elapsed_s: float, cause: str):
        self.elapsed_s = elapsed_s
        super().__init__(
            rank,
            what,
            peer,
            cause,
            f"pipeline rank {rank} gave up on {what} (peer: rank {peer}) after "
            f"{elapsed_s:.1f} s: {cause}",
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
        rank ``peer``) into a :class:`PipelineWaitError` when it timed out or the
        connection broke, else into a :class:`PipelineCommError`; ``bounded``: the block
        waited with this watchdog's timeout."""
        start = time.monotonic()
        try:
            yield
        except RuntimeError as error:
            elapsed = time.monotonic() - start
            text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            lower = text.lower()
            if (bounded and elapsed >= self.timeout_s * 0.99) or "timed out" in lower:
                cause = f"no progress within the {self.timeout_s:g} s timeout ({text})"
            elif any(fragment in lower for fragment in _PEER_LOST):
                cause = f"the connection broke, the peer has probably died ({text})"
            else:
                cause = f"the communication backend failed on this rank ({text})"
                raise PipelineCommError(self.rank, what, peer, cause) from error
            raise PipelineWaitError(self.rank, what, peer, elapsed, cause) from error

    def wait(self, work: _Waitable, what: str, peer: int, *, bounded: bool = True) -> None:
        """Wait for ``work`` (a message ``what`` exchanged with rank ``peer``).

        Raises :class:`PipelineWaitError` when it times out (if ``bounded``) or its
        connection breaks (e.g. the peer's process died), :class:`PipelineCommError` when
        it fails for a reason of this rank's own. Unbounded waits (for sends, which may
        rightly wait long for a busy receiver) end at the process group's own timeout.
        """
        with self.guard(what, peer, bounded=bounded):
            if bounded:
                work.wait(timedelta(seconds=self.timeout_s))
            else:
                work.wait()
