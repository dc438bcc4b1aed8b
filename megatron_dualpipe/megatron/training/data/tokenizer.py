"""Megatron-Core's tokenizers for a training config, and the vocabulary the model gets.

``tokenizer_type`` names Megatron-LM's tokenizer; each is built through Megatron-Core's
``MegatronTokenizer.from_pretrained`` (``megatron.core.tokenizers``), never reimplemented:

- ``HuggingFaceTokenizer``: the ``huggingface`` library over ``tokenizer_model``, a local
  directory as transformers' ``save_pretrained`` writes it (``tokenizer.json`` and
  ``tokenizer_config.json``); nothing is fetched from a hub;
- ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``vocab_file`` and ``merge_file``, through
  the same ``huggingface`` library. Megatron-Core's own route for it (the ``megatron``
  library's ``MegatronHFTokenizer``) asks the Hugging Face hub for the ``gpt2`` tokenizer's
  class, and in 0.16.1 hands ``vocab_file`` over as the merges file; here the class is named
  in a scratch directory beside links to the two files, so the same transformers GPT-2
  tokenizer loads offline from exactly the files given;
- ``NullTokenizer``: the ``null`` library, ids below ``vocab_size`` plus its end-of-document
  id ``vocab_size``.

The model's vocabulary is the tokenizer's padded as Megatron-LM's
``_vocab_size_with_padding`` pads it: up to a multiple of ``make_vocab_size_divisible_by``
x TP. Without a tokenizer (the synthetic data) it is ``vocab_size`` as given. Every problem
with the files is one :class:`~.config.ConfigError` sentence naming the key and the path.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from ...compat.version import null_tokenizer_library
from ..config import ConfigError, TrainConfig, blame

__all__ = [
    "build_tokenizer",
    "check_huggingface_dir",
    "check_tokenizer_files",
    "end_of_document_problem",
    "huggingface_tokenizer",
    "model_vocab_size",
    "padded_vocab_size",
]

#: The file a Hugging Face tokenizer directory holds, and the one naming its class.
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
#: What to install for the tokenizers that need transformers (setup.py's [data] extra).
TRANSFORMERS_INSTALL = "pip install 'transformers>=4.40' 'tokenizers>=0.19'"


def padded_vocab_size(size: int, divisible_by: int, tensor_parallel: int) -> int:
    """``size`` rounded up to a multiple of ``divisible_by x tensor_parallel`` (Megatron-LM's
    ``_vocab_size_with_padding``, megatron/training/tokenizer/tokenizer.py)."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(size / multiple) * multiple)


def check_tokenizer_files(cfg: TrainConfig, source: str) -> None:
    """Refuse, in one sentence, tokenizer files that are missing or not what the tokenizer
    reads, and a missing transformers; before anything is loaded."""
    kind = cfg.tokenizer_type
    if kind == "HuggingFaceTokenizer":
        where = f"{blame(source, 'tokenizer_model')}: tokenizer_model"
        check_huggingface_dir(cfg.tokenizer_model, where)
    for key in ("vocab_file", "merge_file"):
        path = getattr(cfg, key)
        if kind == "GPT2BPETokenizer" and not Path(path).is_file():
            raise ConfigError(f"{blame(source, key)}: {key}: {path} is not a file")
    if kind in ("HuggingFaceTokenizer", "GPT2BPETokenizer") and not _has_transformers():
        raise ConfigError(
            f"{blame(source, 'tokenizer_type')}: tokenizer_type: "
            f"{kind} needs the transformers package, which is not "
            f"installed: {TRANSFORMERS_INSTALL}"
        )


def check_huggingface_dir(directory: str | Path, where: str) -> None:
    """Refuse, in one sentence starting with ``where``, a path that is not a Hugging Face
    tokenizer directory (``tokenizer.json`` and ``tokenizer_config.json``)."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file" if directory.exists() else "does not exist"
        raise ConfigError(
            f"{where}: {directory} {what}: point it at a Hugging Face tokenizer directory "
            f"(holding {TOKENIZER_JSON}, as transformers' save_pretrained writes it)"
        )
    if not (directory / TOKENIZER_JSON).is_file():
        raise ConfigError(
            f"{where}: {directory} holds no {TOKENIZER_JSON}: point it at a Hugging Face "
            "tokenizer directory (as transformers' save_pretrained writes it)"
        )
    if not (directory / TOKENIZER_CONFIG).is_file():
        raise ConfigError(
            f"{where}: {directory} has {TOKENIZER_JSON} but no {TOKENIZER_CONFIG}, which names "
            "the tokenizer's class: save the tokenizer with transformers' save_pretrained"
        )
    if not _has_transformers():
        raise ConfigError(
            f"{where}: reading a Hugging Face tokenizer needs the transformers package, which "
            f"is not installed: {TRANSFORMERS_INSTALL}"
        )


def _has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def build_tokenizer(cfg: TrainConfig, source: str = "config") -> Any | None:
    """Megatron-Core's tokenizer of ``cfg`` (see the module docstring), or None for the
    synthetic data; ConfigError when its files cannot be loaded."""
    if cfg.tokenizer_type is None:
        return None
    check_tokenizer_files(cfg, source)
    from megatron.core.tokenizers import MegatronTokenizer

    if cfg.tokenizer_type == "NullTokenizer":
        metadata = {"library": null_tokenizer_library()}
        return MegatronTokenizer.from_pretrained(metadata_path=metadata, vocab_size=cfg.vocab_size)
    if cfg.tokenizer_type == "HuggingFaceTokenizer":
        where = f"{blame(source, 'tokenizer_model')}: tokenizer_model"
        tokenizer = huggingface_tokenizer(cfg.tokenizer_model, where)
        problem = end_of_document_problem(tokenizer, cfg.tokenizer_model)
        if problem is not None:
            raise ConfigError(f"{where}: {problem}")
        return tokenizer
    with tempfile.TemporaryDirectory(prefix="gpt2-bpe-") as scratch:
        os.symlink(Path(cfg.vocab_file).resolve(), Path(scratch) / "vocab.json")
        os.symlink(Path(cfg.merge_file).resolve(), Path(scratch) / "merges.txt")
        config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}
        (Path(scratch) / TOKENIZER_CONFIG).write_text(json.dumps(config), encoding="utf-8")
        return huggingface_tokenizer(scratch, f"{blame(source, 'vocab_file')}: vocab_file")


def huggingface_tokenizer(directory: str | Path, where: str) -> Any:
    """Megatron-Core's ``huggingface`` tokenizer of a local directory; ConfigError starting
    with ``where`` when it does not load. The fast tokenizer and no special tokens in
    ``tokenize`` are asked for explicitly: Megatron-Core's defaults for both changed between
    0.16.1 (False, False) and 0.19 (True, True)."""
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=str(directory),
            metadata_path={"library": "huggingface"},
            use_fast=True,
            include_special_tokens=False,
        )
    except (ValueError, OSError) as err:
        first = " ".join(str(err).split())[:300]
        raise ConfigError(f"{where}: the tokenizer does not load: {first}") from None


def end_of_document_problem(tokenizer: Any, directory: str | Path) -> str | None:
    """The clause refusing a Hugging Face tokenizer (of ``directory``) without an
    end-of-document token, which Megatron ends every document with; None if it has one."""
    if tokenizer.eod is not None:
        return None
    return (
        f"{directory} has no end-of-document token (eos_token in tokenizer_config.json): "
        "add one, Megatron appends it to every document"
    )


def model_vocab_size(cfg: TrainConfig, tokenizer: Any | None) -> int:
    """The embedding's rows: ``vocab_size`` for the synthetic data, else the tokenizer's
    vocabulary padded (:func:`padded_vocab_size`)."""
    if tokenizer is None:
        return cfg.vocab_size
    return padded_vocab_size(
        tokenizer.vocab_size, cfg.make_vocab_size_divisible_by, cfg.tensor_model_parallel_size
    )
