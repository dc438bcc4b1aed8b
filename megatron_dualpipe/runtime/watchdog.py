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

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Protocol

from ..errors import DualPipeError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HangMonitor",
    "peer_lost",
    "PipelineCommError",
    "PipelineWaitError",
    "Watchdog",
]

logger = logging.getLogger(__name__)

#: How long any pipeline wait (a message, a mirror exchange) may take by default: the
#: default of Megatron-LM's ``--distributed-timeout-minutes`` (10 minutes).
DEFAULT_TIMEOUT_S = 600.0

#: Lower-case fragments of the errors backends raise when the connection to a peer broke
#: (gloo: the peer's socket closed or was reset; NCCL: a remote error).
_PEER_LOST = ("connection closed", "connection reset", "broken pipe", "remote process exited")


def peer_lost(text: str) -> bool:
    """Whether a backend's error message says the connection to a peer broke."""
    lower = text.lower()
    return any(fragment in lower for fragment in _PEER_LOST)


class _Waitable(Protocol):
    def wait(self, timeout: timedelta = ...) -> object: ...


class _Watchable(Protocol):
    def is_completed(self) -> bool: ...


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

    def no_progress(self, detail: str) -> str:
        """The cause every timed-out wait gives (one wording, which the launcher's report
        follows), with ``detail`` in brackets."""
        return f"no progress within the {self.timeout_s:g} s timeout ({detail})"

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
                cause = self.no_progress(text)
            elif peer_lost(lower):
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


class HangMonitor:
    """Turns a hang into an error where the host never waits with a deadline (NCCL:
    ``work.wait()`` only makes the compute stream wait, so the host runs ahead).

    Every operation the rank issues is :meth:`watch` ed from then on, and its clock starts
    when the rank waits on it (:meth:`waiting`): a receive posted early, long before it is
    needed, is no hang. A side thread polls ``is_completed()``, and one still pending
    ``watchdog.timeout_s`` after the rank began to wait on it makes it log a
    :class:`PipelineWaitError` naming the rank, the message and the peer, keep it as
    :attr:`error` and call ``abort`` (which makes the pending operations fail, so nothing
    waits forever). :meth:`check` raises that error on the rank's thread. ``clock``: the
    monotonic seconds it measures with. ``paused``: while it returns True the thread polls
    nothing (``is_completed()`` reads a CUDA event, which a CUDA graph captured in global
    mode, as Transformer Engine captures, forbids on every thread of the process).
    """

    def __init__(
        self,
        watchdog: Watchdog,
        abort: Callable[[], None],
        *,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        paused: Callable[[], bool] | None = None,
    ):
        self._watchdog = watchdog
        self._abort = abort
        self._clock = clock
        self._paused = paused
        self._lock = threading.Lock()
        # Per work: the work, what it is, its peer, when the rank began to wait (or None).
        self._watched: dict[int, tuple[_Watchable, str, int, float | None]] = {}
        self.error: PipelineWaitError | None = None
        self._stop = threading.Event()
        # The thread holds the monitor weakly: a monitor nobody closed ends with its owner.
        self._thread = threading.Thread(
            target=_watch, args=(weakref.ref(self), self._stop, poll_s), name="pipeline-hangs"
        )
        self._thread.daemon = True
        self._thread.start()

    def watch(self, work: _Watchable, what: str, peer: int) -> None:
        """Watch ``work`` (``what``, exchanged with rank ``peer``) from now on; its clock
        starts at :meth:`waiting`."""
        with self._lock:
            self._watched.setdefault(id(work), (work, what, peer, None))

    def waiting(self, work: _Watchable) -> None:
        """The rank waits on ``work`` (watched) from now on: its clock starts, once."""
        with self._lock:
            entry = self._watched.get(id(work))
            if entry is not None and entry[3] is None:
                self._watched[id(work)] = (*entry[:3], self._clock())

    def poll(self) -> bool:
        """Forget what completed; fail on what the rank has waited on past the timeout.
        Whether to go on watching (not after a failure: that is reported once)."""
        if self.error is not None:
            return False
        if self._paused is not None and self._paused():
            return True
        with self._lock:
            watched = list(self._watched.items())
        now = self._clock()
        for key, (work, what, peer, since) in watched:
            if work.is_completed():
                with self._lock:
                    self._watched.pop(key, None)
            elif since is not None and now - since >= self._watchdog.timeout_s:
                self._fail(what, peer, now - since)
                return False
        return True

    def _fail(self, what: str, peer: int, elapsed: float) -> None:
        self.error = PipelineWaitError(
            self._watchdog.rank,
            what,
            peer,
            elapsed,
            self._watchdog.no_progress(
                "seen by the rank's hang monitor, which aborted its pipeline communicators"
            ),
        )
        logger.error("%s", self.error)
        try:
            self._abort()
        except Exception:  # the error above is what the rank reports
            logger.exception("aborting the pipeline communicators failed")

    @property
    def watching(self) -> int:
        """How many operations are watched and not seen complete yet."""
        with self._lock:
            return len(self._watched)

    def check(self) -> None:
        """Raise the hang this monitor saw, if any."""
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Stop watching."""
        self._stop.set()
        self._thread.join()


def _watch(monitor: weakref.ref, stop: threading.Event, poll_s: float) -> None:
    """The hang monitor's thread: poll until stopped, failed, or the monitor is gone."""
    while not stop.wait(poll_s):
        alive = monitor()
        if alive is None or not alive.poll():
            return
        del alive
