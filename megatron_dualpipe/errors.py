"""The base of every exception megatron-dualpipe raises on purpose.

``except DualPipeError`` catches them all; each subclass also derives from the builtin
that fits it (``ValueError`` for bad input, ``RuntimeError`` for a failed run), so code
written against those keeps working. Every message is one sentence that says what is
wrong and what to change.
"""

from __future__ import annotations

__all__ = ["DualPipeError"]


class DualPipeError(Exception):
    """A megatron-dualpipe error; the message says what is wrong and what to do."""
