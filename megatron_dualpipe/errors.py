"""The base of every exception megatron-dualpipe raises on purpose.

``except DualPipeError`` catches them all; each subclass also derives from the builtin
that fits it (``ValueError`` for bad input, ``RuntimeError`` for a failed run), so code
written against those keeps working. Every message is one sentence that says what is
wrong and what to change.
"""

from __future__ import annotations

__all__ = ["DualPipeError"]


class DualPipeError(Exception):
    """A megatron-dualpipe error; the message says what is wrong and what to do.

    ``every_rank``: the error is a verdict that every rank of a run reaches together (one
    collective decided it) and words alike, so a launcher says it once, without a rank,
    even when a peer reports it late."""

    def __init__(self, *args: object, every_rank: bool = False) -> None:
        super().__init__(*args)
        self.every_rank = every_rank
