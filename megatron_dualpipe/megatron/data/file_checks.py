"""The indexed datasets a run names, checked against each other on disk before any rank
starts, for Megatron-LM's loop and ours alike.

A dataset prefix needs its ``.bin`` and ``.idx``, and the two must be one indexed dataset
(:func:`~.indexed_files.read_index`). A split with a weight above 0 that Megatron-Core's
rounding leaves without a token, or a per-split dataset without tokens, is refused:
Megatron-Core's ``GPTDataset._get_num_epochs`` loops for ever on it, on every rank that
builds it. Where the tokenizer's vocabulary is known, a ``.bin`` holding a token id beyond
it is refused (the embedding fails on it only after the ranks start). Each problem is a
sentence that begins with the key naming the data.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .indexed_files import (
    SCAN_BYTES,
    IndexedFiles,
    NotAnIndexedDataset,
    largest_token,
    read_index,
    split_ranges,
)

__all__ = ["data_file_problem"]


def data_file_problem(
    split_blend: Sequence[tuple[str, str]],
    whole: Sequence[tuple[str, str]],
    *,
    split: str | None,
    vocabulary: int | None = None,
    tokenizer: str = "",
    validation_off: str | None = None,
    weighted: bool = True,
    seq_length: int | None = None,
) -> tuple[str, str] | None:
    """The first problem of the datasets, as (the key naming them, a sentence saying what
    is wrong and what to change), or None. ``split_blend``: (key, prefix) of the blend that
    ``split`` divides (not checked by split where ``split`` is None), ``weighted`` where it
    gives weights (where not, each split of several datasets needs a sample of
    ``seq_length`` + 1 tokens); ``whole``: (key, prefix) of the per-split blends;
    ``vocabulary``: the tokenizer's number of ids (its name ``tokenizer``), None to leave
    token ids unchecked; ``validation_off``: how the config turns validation off, offered
    where the validation split gets no token."""
    for key, prefix in (*split_blend, *whole):
        for suffix in (".idx", ".bin"):
            if not Path(prefix + suffix).is_file():
                return key, (
                    f"{key}: {prefix}{suffix} does not exist: name each dataset by the prefix "
                    "its .bin and .idx share (megatron-dualpipe preprocess --output-prefix P "
                    "writes P_text_document.bin and .idx)"
                )
        try:
            index = read_index(prefix)
        except (NotAnIndexedDataset, OSError) as err:
            return key, (
                f"{key}: {prefix}.idx and {prefix}.bin are not one indexed dataset ({err}): "
                "write both again from the corpus with megatron-dualpipe preprocess (or "
                "Megatron-LM's tools/preprocess_data.py), and name the prefix they share"
            )
        # An unweighted blend of several datasets weighs each by its samples: Megatron-Core's
        # BlendedDataset asserts them all above 0 (rank 0 stops, without a message).
        sample = seq_length + 1 if seq_length and not weighted and len(split_blend) > 1 else None
        tokens = (
            _empty_split(prefix, index, split, validation_off, sample=sample)
            if (key, prefix) in split_blend
            else _no_tokens(key, prefix, index)
        )
        problem = tokens or _beyond_vocabulary(key, prefix, index, vocabulary, tokenizer)
        if problem is not None:
            return key, problem
    return None


def _beyond_vocabulary(
    key: str, prefix: str, index: IndexedFiles, vocabulary: int | None, tokenizer: str
) -> str | None:
    """``key: ...`` with what to change where ``prefix.bin`` holds a token id the
    tokenizer (``vocabulary`` ids) does not have; None where it holds none. The ``.bin`` is
    read whole up to :data:`~.indexed_files.SCAN_BYTES`, else a sample of that size, and
    not at all where its dtype cannot hold such an id."""
    if vocabulary is None or np.iinfo(index.dtype).max < vocabulary:
        return None
    largest, whole = largest_token(prefix, index.dtype)
    if largest < vocabulary:
        return None
    read = "" if whole else f" (in a sample of {SCAN_BYTES >> 20:,} MiB)"
    return (
        f"{key}: {prefix}.bin holds token id {largest:,}{read}, beyond the {vocabulary:,} ids "
        f"of the tokenizer ({tokenizer}): train with the tokenizer that wrote it, or "
        "preprocess the corpus again with this one"
    )


def _no_tokens(key: str, prefix: str, index: IndexedFiles) -> str | None:
    """``key: ...`` where the per-split dataset ``prefix`` holds no token."""
    documents = len(index.sequence_lengths)
    if index.tokens(0, documents):
        return None
    return (
        f"{key}: {prefix} holds no tokens ({documents} documents), and Megatron-Core's "
        "GPTDataset loops for ever on a dataset without tokens: preprocess a corpus with "
        f"text into it, or leave it out of {key}"
    )


#: What Megatron-Core does with a split without tokens: a dataset alone, or weighted in a
#: blend; one of an unweighted blend of several (which weighs each by its samples, and a
#: split of at most seq_length tokens makes none).
_LOOPS = "and Megatron-Core's GPTDataset loops for ever on a split without tokens"
_STOPS = (
    "not one sample of seq_length + 1 tokens, and Megatron-Core's BlendedDataset stops "
    "rank 0 on it with a bare AssertionError while the other ranks wait for it (an "
    "unweighted blend weighs each dataset by its samples)"
)


def _empty_split(
    prefix: str,
    index: IndexedFiles,
    split: str | None,
    validation_off: str | None,
    *,
    sample: int | None = None,
) -> str | None:
    """``split: ...`` where a split of ``prefix`` with a weight above 0 gets no token (with
    ``sample``, the tokens of one sample in an unweighted blend of several datasets: fewer
    than that), with what Megatron-Core does then (loop for ever; in that blend, fail an
    assertion) and what to change; None where every split has them (or ``split`` is
    None)."""
    if split is None:
        return None
    documents = len(index.sequence_lengths)
    ranges = split_ranges(split, documents)
    for position, found in enumerate(ranges):
        if found is None or index.tokens(found[2].start, found[2].stop) >= (sample or 1):
            continue
        name, weight, taken = found
        words = [w for w in re.split(r"[,/ ]+", split.strip()) if w]
        words += ["0"] * (3 - len(words))
        smallest = min(r[1] for r in ranges if r is not None)
        enough = math.floor(1 / smallest) + 1  # every positive share then exceeds a document
        advice = f"a corpus of at least {enough:,} documents"
        if sample and index.tokens(taken.start, taken.stop):
            advice = f"give the blend weights, or this split at least {sample:,} tokens"
        if name != "train":
            words[position] = "0"
            off = f" and {validation_off}" if name == "valid" and validation_off else ""
            advice = f"set its weight to 0 (split: {','.join(words)}){off}, or {advice}"
        return (
            f"split: {split} gives the {name} split {len(taken)} of the {documents:,} "
            f"documents of {prefix} ({weight:.2%} of them, rounded by Megatron-Core to "
            f"documents {taken.start} to {taken.stop}; {index.tokens(taken.start, taken.stop)} "
            f"tokens), {_STOPS if sample else _LOOPS}: {advice}"
        )
    return None
