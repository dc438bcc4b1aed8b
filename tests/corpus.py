"""A small text corpus and a BPE tokenizer trained on it offline, for the real-data tests.

The corpus is jsonl (one ``{"text": ...}`` object a line, as Megatron-LM's preprocessing
reads it): sentences drawn with a fixed seed from a little grammar, so a model can learn
them and the loss falls. The tokenizer is a byte-level BPE trained on the corpus with the
``tokenizers`` package by ``make-tokenizer``'s function and saved as a Hugging Face
tokenizer directory (``tokenizer.json`` and ``tokenizer_config.json``, through
transformers' ``save_pretrained``), with ``<|endoftext|>`` as its end-of-document token.
Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from megatron_dualpipe.megatron.data.make_tokenizer import make_tokenizer

__all__ = ["EOD", "train_tokenizer", "write_corpus"]

EOD = "<|endoftext|>"
_SUBJECTS = ("the cat", "a dog", "my friend", "the old sailor", "every child", "the robot")
_VERBS = ("sees", "follows", "paints", "finds", "remembers", "builds")
_OBJECTS = ("a red boat", "the quiet river", "seven stones", "the tall tower", "a small bird")
_ENDINGS = ("today.", "at night.", "in the rain.", "before dinner.", "again and again.")


def write_corpus(
    path: Path, documents: int = 120, seed: int = 0, per_document: tuple[int, int] = (2, 6)
) -> Path:
    """``documents`` lines of ``per_document`` (least, most) sentences each into ``path``;
    returns ``path``."""
    rng = random.Random(seed)
    lines = []
    for _ in range(documents):
        sentences = [
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
            f"{rng.choice(_ENDINGS)}"
            for _ in range(rng.randint(*per_document))
        ]
        lines.append(json.dumps({"text": " ".join(sentences).capitalize()}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def train_tokenizer(corpus: Path, directory: Path, vocab_size: int = 320) -> Path:
    """A byte-level BPE of ``vocab_size`` tokens trained on ``corpus``'s texts, saved as a
    Hugging Face tokenizer directory (``make-tokenizer``'s recipe); returns ``directory``."""
    return make_tokenizer(corpus, directory, vocab_size=vocab_size, eod=EOD).directory
