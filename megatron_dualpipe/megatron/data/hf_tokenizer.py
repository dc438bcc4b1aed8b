"""A Hugging Face tokenizer directory, checked and loaded through Megatron-Core's
``huggingface`` tokenizer (``MegatronTokenizer.from_pretrained``), for ``preprocess`` and
``make-tokenizer``: every problem with the directory is one :class:`TokenizerError`
sentence starting with what names it. Nothing is fetched from a hub."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ...errors import DualPipeError

__all__ = [
    "TOKENIZER_CONFIG",
    "TOKENIZER_JSON",
    "TRANSFORMERS_INSTALL",
    "TokenizerError",
    "has_transformers",
    "check_huggingface_dir",
    "end_of_document_problem",
    "huggingface_tokenizer",
]

#: The file a Hugging Face tokenizer directory holds, and the one naming its class.
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
#: What to install for the tokenizers that need transformers (setup.py's [data] extra).
TRANSFORMERS_INSTALL = "pip install 'transformers>=4.40' 'tokenizers>=0.19'"


class TokenizerError(DualPipeError):
    """A tokenizer directory that cannot be used (one sentence)."""


def check_huggingface_dir(directory: str | Path, where: str) -> None:
    """Refuse, in one sentence starting with ``where``, a path that is not a Hugging Face
    tokenizer directory (``tokenizer.json`` and ``tokenizer_config.json``)."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file" if directory.exists() else "does not exist"
        raise TokenizerError(
            f"{where}: {directory} {what}: point it at a Hugging Face tokenizer directory "
            f"(holding {TOKENIZER_JSON}, as transformers' save_pretrained writes it)"
        )
    if not (directory / TOKENIZER_JSON).is_file():
        raise TokenizerError(
            f"{where}: {directory} holds no {TOKENIZER_JSON}: point it at a Hugging Face "
            "tokenizer directory (as transformers' save_pretrained writes it)"
        )
    if not (directory / TOKENIZER_CONFIG).is_file():
        raise TokenizerError(
            f"{where}: {directory} has {TOKENIZER_JSON} but no {TOKENIZER_CONFIG}, which names "
            "the tokenizer's class: save the tokenizer with transformers' save_pretrained"
        )
    if not has_transformers():
        raise TokenizerError(
            f"{where}: reading a Hugging Face tokenizer needs the transformers package, which "
            f"is not installed: {TRANSFORMERS_INSTALL}"
        )


def has_transformers() -> bool:
    """Whether the transformers package (the [data] extra) is installed."""
    return importlib.util.find_spec("transformers") is not None


def huggingface_tokenizer(directory: str | Path, where: str) -> Any:
    """Megatron-Core's ``huggingface`` tokenizer of a local directory; TokenizerError starting
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
        raise TokenizerError(f"{where}: the tokenizer does not load: {first}") from None


def end_of_document_problem(tokenizer: Any, directory: str | Path) -> str | None:
    """The clause refusing a Hugging Face tokenizer (of ``directory``) without an
    end-of-document token, which Megatron ends every document with; None if it has one."""
    if tokenizer.eod is not None:
        return None
    return (
        f"{directory} has no end-of-document token (eos_token in tokenizer_config.json): "
        "add one, Megatron appends it to every document"
    )
