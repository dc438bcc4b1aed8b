"""``megatron-dualpipe preprocess``: a jsonl corpus into Megatron's indexed dataset.

What Megatron-LM's ``tools/preprocess_data.py`` does for one ``text`` key at document level,
through Megatron-Core's own parts: each line of the input is a JSON object whose ``text`` is
one document; Megatron-Core's ``huggingface`` tokenizer (:mod:`.tokenizer`) turns it into
ids, the tokenizer's end-of-document id is appended, and Megatron-Core's
``IndexedDatasetBuilder`` writes ``<prefix>_text_document.bin`` and ``.idx`` (token dtype
as ``DType.optimal_dtype`` picks it for the vocabulary). ``data_path:
<prefix>_text_document`` then trains on it.

Every problem is one sentence naming the file and, for the corpus, the line: a missing or
unreadable input, a line that is not JSON, an object without a string ``text``, a corpus
without documents, a tokenizer directory without ``tokenizer.json`` (or without an
end-of-document token). The two files are written under temporary names and renamed only
when both are complete, so an interrupted or refused run leaves nothing that reads as a
dataset (and removes what it began).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError
from .tokenizer import check_huggingface_dir, huggingface_tokenizer

__all__ = ["PreprocessError", "Preprocessed", "preprocess"]

#: The JSON key read from every line, and the suffix Megatron-LM gives its output prefix.
TEXT_KEY = "text"
SUFFIX = "_text_document"


class PreprocessError(ConfigError):
    """The corpus, the tokenizer or the output cannot be used (one sentence)."""


@dataclass(frozen=True)
class Preprocessed:
    """What a preprocessing run wrote: the dataset prefix (``data_path``), its documents and
    tokens (end-of-document ids included)."""

    prefix: str
    documents: int
    tokens: int


def _documents(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every non-blank line of the corpus; PreprocessError naming the
    line where one is not a JSON object with a string ``text``."""
    try:
        stream = path.open(encoding="utf-8")
    except OSError as err:
        what = "does not exist" if isinstance(err, FileNotFoundError) else err.strerror
        raise PreprocessError(f"--input: {path} {what}: give a jsonl file") from None
    with stream:
        try:
            for number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                yield number, _text(path, number, line)
        except UnicodeDecodeError as err:
            raise PreprocessError(
                f"{path}: not UTF-8 text ({err.reason} at byte {err.start} of a line): save "
                "the corpus as UTF-8"
            ) from None


def _text(path: Path, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise PreprocessError(
            f"{path} line {number}: not JSON ({err.msg} at column {err.colno}): write one JSON "
            f'object per line, such as {{"text": "..."}}'
        ) from None
    if not isinstance(record, dict) or TEXT_KEY not in record:
        raise PreprocessError(
            f'{path} line {number}: no "{TEXT_KEY}" field: each line must be a JSON object '
            f'with the document in "{TEXT_KEY}"'
        )
    text = record[TEXT_KEY]
    if not isinstance(text, str):
        raise PreprocessError(
            f'{path} line {number}: "{TEXT_KEY}" is {type(text).__name__}, not a string'
        )
    return text


def _count_lines(path: Path) -> int:
    with path.open("rb") as stream:
        return sum(1 for _ in stream)


def preprocess(
    input_path: str | Path,
    tokenizer_dir: str | Path,
    output_prefix: str,
    progress: Callable[[int, int], None] | None = None,
) -> Preprocessed:
    """Tokenize ``input_path`` (jsonl) with the Hugging Face tokenizer in ``tokenizer_dir``
    into ``<output_prefix>_text_document.bin/.idx``; ``progress(lines done, lines)`` is
    called as lines are read. Raises :class:`PreprocessError`."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    source = Path(input_path)
    check_huggingface_dir(tokenizer_dir, "--tokenizer")
    documents = _documents(source)
    first = next(documents, None)  # a missing file or a bad first line before any work
    if first is None:
        raise PreprocessError(
            f"{source}: no documents (every line is blank): write one JSON object per line "
            f'with the document in "{TEXT_KEY}"'
        )
    tokenizer = huggingface_tokenizer(tokenizer_dir, "--tokenizer")
    eod = tokenizer.eod
    if eod is None:
        raise PreprocessError(
            f"--tokenizer: {tokenizer_dir} has no end-of-document token (eos_token in "
            "tokenizer_config.json): add one, Megatron appends it to every document"
        )
    prefix = output_prefix + SUFFIX
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    partial = f"{prefix}.incomplete-{os.getpid()}"
    total_lines = _count_lines(source)
    builder = IndexedDatasetBuilder(
        partial + ".bin", dtype=DType.optimal_dtype(tokenizer.vocab_size)
    )
    count = tokens = 0
    try:
        for number, text in itertools.chain([first], documents):
            ids = [*tokenizer.tokenize(text), eod]
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
            count, tokens = count + 1, tokens + len(ids)
            if progress is not None:
                progress(number, total_lines)
        builder.finalize(partial + ".idx")
        os.replace(partial + ".bin", prefix + ".bin")
        os.replace(partial + ".idx", prefix + ".idx")
    finally:
        builder.data_file.close()
        for leftover in (partial + ".bin", partial + ".idx"):
            Path(leftover).unlink(missing_ok=True)
    return Preprocessed(prefix, count, tokens)
