"""``megatron-dualpipe make-tokenizer``: an offline BPE tokenizer for ``preprocess`` and
``train``.

:func:`make_tokenizer` trains GPT-2's recipe, a byte-level BPE with the ``tokenizers``
library, on a ``preprocess`` corpus (jsonl, or a ``.txt`` file with a document a line) up
to ``vocab_size`` tokens, with ``eod`` as its only special token, and saves the directory
Megatron-Core's ``HuggingFaceTokenizer`` loads. Nothing is downloaded or overwritten; every
problem is one sentence. The recipe and its checks: docs/training.md, "Your own data".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .hf_tokenizer import TOKENIZER_JSON, TRANSFORMERS_INSTALL
from .preprocess import (
    DEFAULT_MAX_DOCUMENT_CHARS,
    TEXT_KEY,
    PreprocessError,
    check_options,
    decode_line,
    document_texts,
)

__all__ = ["EOD", "MIN_VOCAB_SIZE", "MadeTokenizer", "make_tokenizer"]

#: GPT-2's end-of-document token, the default ``eod``.
EOD = "<|endoftext|>"
#: The byte alphabet and the end-of-document token.
MIN_VOCAB_SIZE = 257


@dataclass(frozen=True)
class MadeTokenizer:
    """The tokenizer directory written, its vocabulary and the documents it was trained on."""

    directory: Path
    vocab_size: int
    documents: int


def make_tokenizer(
    corpus: str | Path,
    output: str | Path,
    *,
    vocab_size: int,
    json_keys: Sequence[str] = (TEXT_KEY,),
    eod: str = EOD,
    min_frequency: int = 0,
) -> MadeTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens on ``corpus`` (docs/training.md)
    and save it to ``output``; ``min_frequency``: the fewest occurrences of a
    pair merged (0: the ``tokenizers`` default). Raises PreprocessError (before training)."""
    source, directory = Path(corpus), Path(output)
    keys = check_options(json_keys, 1, DEFAULT_MAX_DOCUMENT_CHARS)
    if vocab_size < MIN_VOCAB_SIZE:
        raise PreprocessError(
            f"--vocab-size: {vocab_size} is below {MIN_VOCAB_SIZE} (the 256 bytes and the "
            "end-of-document token): give a larger one, e.g. 32000"
        )
    if (directory / TOKENIZER_JSON).exists():
        raise PreprocessError(
            f"--output: {directory} already holds a tokenizer ({TOKENIZER_JSON}): choose "
            "another --output, or remove it"
        )
    if directory.exists() and not directory.is_dir():
        raise PreprocessError(f"--output: {directory} is a file: choose a directory")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise PreprocessError(
            f"make-tokenizer needs the tokenizers and transformers packages: {TRANSFORMERS_INSTALL}"
        ) from None
    documents = _Documents(source, keys)
    next(iter(documents))  # a missing corpus, a bad first line, or none: before training
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eod],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter(documents), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eod)
    try:
        fast.save_pretrained(directory)
    except OSError as err:
        raise PreprocessError(
            f"--output: cannot write {directory}: {err.strerror or err}: choose another --output"
        ) from None
    return MadeTokenizer(directory, tokenizer.get_vocab_size(), documents.count)


class _Documents:
    """The corpus's documents, read afresh by each iteration; ``count`` of the last one."""

    def __init__(self, path: Path, keys: tuple[str, ...]) -> None:
        self.path, self.keys, self.count = path, keys, 0

    def __iter__(self) -> Iterator[str]:
        self.count = 0
        try:
            stream = self.path.open("rb")
        except OSError as err:
            what = "does not exist" if isinstance(err, FileNotFoundError) else err.strerror
            raise PreprocessError(
                f"--input: {self.path} {what}: give a jsonl or .txt file"
            ) from None
        with stream:
            for number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                if self.path.suffix == ".txt":
                    texts = [decode_line(self.path, number, line).rstrip("\r\n")]
                else:
                    texts = document_texts(
                        self.path, number, line, self.keys, DEFAULT_MAX_DOCUMENT_CHARS
                    )
                self.count += 1
                yield from texts
        if not self.count:
            raise PreprocessError(
                f"--input: {self.path} holds no document (every line is blank): write one "
                "document a line"
            )
