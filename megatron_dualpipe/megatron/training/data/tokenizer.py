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

import functools
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...compat.version import null_tokenizer_library
from ...data.hf_tokenizer import (
    TOKENIZER_CONFIG,
    TRANSFORMERS_INSTALL,
    TokenizerError,
    check_huggingface_dir,
    end_of_document_problem,
    has_transformers,
    huggingface_tokenizer,
)
from ..config import ConfigError, TrainConfig, blame

__all__ = ["build_tokenizer", "check_tokenizer_files", "model_vocab_size", "padded_vocab_size"]


def padded_vocab_size(size: int, divisible_by: int, tensor_parallel: int) -> int:
    """``size`` rounded up to a multiple of ``divisible_by x tensor_parallel`` (Megatron-LM's
    ``_vocab_size_with_padding``, megatron/training/tokenizer/tokenizer.py)."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(size / multiple) * multiple)


def _config_errors(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` raising the tokenizer helpers' :class:`TokenizerError` as the config's
    ConfigError (the same sentence)."""

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except TokenizerError as err:
            raise ConfigError(str(err)) from None

    return wrapped


@_config_errors
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
    if kind in ("HuggingFaceTokenizer", "GPT2BPETokenizer") and not has_transformers():
        raise ConfigError(
            f"{blame(source, 'tokenizer_type')}: tokenizer_type: "
            f"{kind} needs the transformers package, which is not "
            f"installed: {TRANSFORMERS_INSTALL}"
        )


@_config_errors
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


def model_vocab_size(cfg: TrainConfig, tokenizer: Any | None) -> int:
    """The embedding's rows: ``vocab_size`` for the synthetic data, else the tokenizer's
    vocabulary padded (:func:`padded_vocab_size`)."""
    if tokenizer is None:
        return cfg.vocab_size
    return padded_vocab_size(
        tokenizer.vocab_size, cfg.make_vocab_size_divisible_by, cfg.tensor_model_parallel_size
    )
