"""Megatron-Core's indexed dataset (a ``.bin`` of tokens and its ``.idx``) checked on disk,
and the documents each split of ``split`` takes from it, before any rank starts.

:func:`read_index` checks every part of the ``.idx`` against the ``.bin`` (each token the
index counts there, at its offset, and nothing more); a mismatch is one
:class:`NotAnIndexedDataset` clause. :func:`split_ranges` reproduces Megatron-Core's split
arithmetic, so a split that gets no tokens is known before Megatron-Core would loop for
ever on it. The layout and what Megatron-Core checks itself: docs/reliability.md, "Data
files".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

__all__ = ["IndexedFiles", "NotAnIndexedDataset", "largest_token", "read_index", "split_ranges"]

#: Bytes before the sequence lengths: magic, version, dtype code, the two counts.
_HEADER_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8
#: Sequences compared at a time (bounds the memory of checking a large index).
_CHUNK = 1 << 22
#: Bytes of a ``.bin`` :func:`largest_token` reads: all of a ``.bin`` up to this size, else
#: evenly spaced windows of ``_WINDOW`` bytes adding up to it (a bounded sample).
SCAN_BYTES = 1 << 30
_WINDOW = 1 << 24


class NotAnIndexedDataset(ValueError):
    """The ``.idx`` and ``.bin`` of a prefix are not one indexed dataset; the message is
    a clause saying what does not match."""


@dataclass(frozen=True)
class IndexedFiles:
    """What a checked ``.idx`` says: its token dtype and each sequence's length in tokens
    (Megatron-Core's GPT splits count sequences, one per document as ``preprocess`` and
    Megatron-LM's ``preprocess_data.py`` without ``--split-sentences`` write them)."""

    dtype: np.dtype
    sequence_lengths: np.ndarray

    def tokens(self, first: int, end: int) -> int:
        """Tokens in sequences ``first`` to ``end - 1``."""
        return int(self.sequence_lengths[first:end].sum(dtype=np.int64))


def read_index(prefix: str) -> IndexedFiles:
    """``prefix.idx`` read and checked against ``prefix.bin`` (docs/reliability.md);
    :class:`NotAnIndexedDataset` naming the first mismatch."""
    idx, binary = Path(prefix + ".idx"), Path(prefix + ".bin")
    size = idx.stat().st_size
    with idx.open("rb") as stream:
        head = stream.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES:
        raise NotAnIndexedDataset(f"the .idx holds {size} bytes, less than an index's header")
    if head[: len(_INDEX_HEADER)] != _INDEX_HEADER:
        raise NotAnIndexedDataset(
            f"the .idx does not begin with Megatron's index magic {_INDEX_HEADER!r}"
        )
    version, code, sequences, entries = struct.unpack_from("<QBQQ", head, len(_INDEX_HEADER))
    if version != 1:
        raise NotAnIndexedDataset(f"the .idx is of version {version}, not 1")
    try:
        dtype = np.dtype(DType.dtype_from_code(code))
    except ValueError:
        message = f"the .idx names token dtype code {code}, not one of Megatron-Core's"
        raise NotAnIndexedDataset(message) from None
    arrays = _HEADER_BYTES + sequences * 12 + entries * 8
    if size not in (arrays, arrays + sequences):  # the second: a multimodal index's modes
        raise NotAnIndexedDataset(
            f"the .idx holds {size:,} bytes, but its header's {sequences:,} sequences and "
            f"{entries:,} document-index entries take {arrays:,}"
        )
    raw = np.memmap(idx, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(raw, np.int32, sequences, _HEADER_BYTES)
    pointers = np.frombuffer(raw, np.int64, sequences, _HEADER_BYTES + sequences * 4)
    documents = np.frombuffer(raw, np.int64, entries, _HEADER_BYTES + sequences * 12)
    total = _check_sequences(lengths, pointers, dtype.itemsize)
    have = binary.stat().st_size
    if total * dtype.itemsize != have:
        raise NotAnIndexedDataset(
            f"the .idx counts {total:,} tokens of {dtype.name} ({total * dtype.itemsize:,} "
            f"bytes) but the .bin holds {have:,} bytes"
        )
    _check_documents(documents, sequences)
    return IndexedFiles(dtype, lengths)


def _check_sequences(lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> int:
    """The tokens the sequences hold, after checking every length is >= 0 and every
    sequence starts where the one before ends (the first at 0); a chunk at a time."""
    position = 0
    for start in range(0, len(lengths), _CHUNK):
        chunk = lengths[start : start + _CHUNK].astype(np.int64)
        if chunk.min() < 0:
            at = start + int(np.argmax(chunk < 0))
            raise NotAnIndexedDataset(f"the .idx gives sequence {at} a negative length")
        ends = position + np.cumsum(chunk) * itemsize
        starts = np.concatenate(([position], ends[:-1]))
        wrong = np.flatnonzero(pointers[start : start + _CHUNK] != starts)
        if wrong.size:
            at = start + int(wrong[0])
            raise NotAnIndexedDataset(
                f"the .idx puts sequence {at} at byte {int(pointers[at]):,} of the .bin, "
                f"where the sequences before it end at byte {int(starts[wrong[0]]):,}"
            )
        position = int(ends[-1])
    return position // itemsize


def _check_documents(documents: np.ndarray, sequences: int) -> None:
    """The document index: from 0 to the sequence count, never decreasing."""
    if documents.size == 0 or documents[0] != 0 or documents[-1] != sequences:
        ends = f"{int(documents[0])} to {int(documents[-1])}" if documents.size else "empty"
        raise NotAnIndexedDataset(
            f"the .idx's document index runs {ends}, not from 0 to its {sequences:,} sequences"
        )
    steps = np.diff(documents)
    if steps.size and steps.min() < 0:
        at = int(np.argmax(steps < 0)) + 1
        raise NotAnIndexedDataset(
            f"the .idx's document index goes back at entry {at} ({int(documents[at - 1])} "
            f"then {int(documents[at])})"
        )


def largest_token(prefix: str, dtype: np.dtype, budget: int = SCAN_BYTES) -> tuple[int, bool]:
    """(the largest token id read from ``prefix.bin`` of ``dtype`` tokens, whether the
    whole ``.bin`` was read): all of it up to ``budget`` bytes, else evenly spaced windows
    adding up to ``budget`` (see :data:`SCAN_BYTES`); -1 for an empty ``.bin``."""
    if Path(prefix + ".bin").stat().st_size == 0:
        return -1, True
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    window = _WINDOW // dtype.itemsize
    whole = tokens.nbytes <= budget
    if whole:
        starts = range(0, tokens.size, window)
    else:
        count = max(1, budget // _WINDOW)
        starts = np.linspace(0, tokens.size - window, count).astype(np.int64)
    return max(int(tokens[start : start + window].max()) for start in starts), whole


#: Megatron-Core's split names, in ``split``'s order.
SPLITS = ("train", "valid", "test")


def split_ranges(split: str, sequences: int) -> list[tuple[str, float, range] | None]:
    """Per split of ``split`` (train, valid, test): (its name, its normalised weight, the
    sequences Megatron-Core gives it out of ``sequences``), None for a split of weight 0."""
    weights = parse_and_normalize_split(split)
    found: list[tuple[str, float, range] | None] = []
    for name, weight, ends in zip(
        SPLITS, weights, convert_split_vector_to_split_matrix(weights), strict=True
    ):
        if ends is None:
            found.append(None)
            continue
        first, end = (int(round(end * float(sequences))) for end in ends)
        found.append((name, weight, range(first, end)))
    return found
