"""The rules of a training config's data and tokenizer keys: the split, the blend, where
the tokens come from and which tokenizer files each tokenizer needs. No torch or megatron
import."""

from __future__ import annotations

import re

from .keys import NUMBER, Problem, TrainConfig

__all__ = [
    "DATA_PATH_KEYS",
    "blend_problem",
    "check_data",
    "check_tokenizer",
    "split_problem",
    "split_weights",
]

#: The keys that name indexed datasets.
DATA_PATH_KEYS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def split_weights(split: str) -> list[float] | None:
    """``split`` (``969,30,1``; commas or slashes) as three weights, the missing ones 0, as
    Megatron-Core reads it; None when it is not 1 to 3 numbers >= 0 with a positive sum
    (:func:`split_problem` says which)."""
    return None if split_problem(split) else _split_numbers(split)


def _split_numbers(split: str) -> list[float] | None:
    """``split``'s 1 to 3 numbers (of any sign) padded with 0 to three, or None."""
    words = [w for w in re.split(r"[,/ ]+", split.strip()) if w]
    if not 1 <= len(words) <= 3 or not all(NUMBER.match(w) for w in words):
        return None
    return [float(w) for w in words] + [0.0] * (3 - len(words))


def split_problem(split: str) -> str | None:
    """What is wrong with ``split`` as a clause with what to change, or None. Megatron-Core
    reads only its digits (``-10,110,0`` as 10,110,0), so a sign is refused here."""
    weights = _split_numbers(split)
    if weights is None:
        return f"{split!r} is not up to three weights such as 969,30,1 (train, valid, test)"
    if min(weights) < 0:
        return f"{split!r} has a negative weight: give each of train, valid, test a weight >= 0"
    if sum(weights) == 0:
        return (
            f"{split!r} gives every split weight 0: give the training split a weight above 0 "
            "(969,30,1)"
        )
    return None


def blend_problem(words: str) -> str | None:
    """What is wrong with a data path's words (Megatron-Core's ``get_blend_from_list``:
    prefixes, or weight-prefix pairs with weights >= 0), or None."""
    items = words.split()
    pairs = "pairs of a weight and a prefix (0.7 data/a_text_document 0.3 data/b_text_document)"
    if len(items) % 2 == 1:
        number = next((w for w in items if NUMBER.match(w)), None)
        if number is None or len(items) == 1:
            return None
        return (
            f"{words!r} has {len(items)} words, among them the number {number!r}: a blend "
            f"alternates weight and prefix, so give dataset prefixes alone, or {pairs}"
        )
    weights = items[0::2]
    if not all(NUMBER.match(w) for w in weights):
        odd = next(w for w in weights if not NUMBER.match(w))
        return f"{odd!r} stands where a blend weight goes: give dataset prefixes alone, or {pairs}"
    if min(float(w) for w in weights) < 0:
        negative = next(w for w in weights if float(w) < 0)
        return f"blend weight {negative} is negative: give each dataset a weight >= 0"
    if max(float(w) for w in weights) == 0:
        return "every blend weight is 0: give at least one dataset a weight above 0"
    return None


def check_data(cfg: TrainConfig) -> Problem:
    """Where the tokens come from: data_path (with split), the per-split paths, mock_data,
    or (none of them) the synthetic data."""
    per_split = [k for k in DATA_PATH_KEYS[1:] if getattr(cfg, k) is not None]
    if cfg.data_path is not None and per_split:
        return per_split[0], (
            "and data_path are both set: choose data_path (split by split) or the per-split paths"
        )
    if cfg.mock_data and (cfg.data_path is not None or per_split):
        return "mock_data", "replaces data files: unset it, or unset the data paths"
    if per_split and cfg.train_data_path is None:
        return "train_data_path", f"required with {per_split[0]}: the training split's datasets"
    for key in DATA_PATH_KEYS:
        value = getattr(cfg, key)
        problem = None if value is None else blend_problem(value)
        if problem is not None:
            return key, problem
    problem = split_problem(cfg.split)
    if problem is not None:
        return "split", problem
    if not cfg.uses_data_files and not cfg.mock_data:
        for key in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(cfg, key):
                return key, (
                    "applies to documents of data_path or mock_data; the synthetic data has none"
                )
    if cfg.eval_interval is not None and cfg.uses_data_files:
        if cfg.data_path is not None and split_weights(cfg.split)[1] == 0:
            return "split", (
                f"{cfg.split!r} gives the validation split no documents but eval_interval is "
                "set: give it a weight (969,30,1) or unset eval_interval"
            )
        if cfg.train_data_path is not None and cfg.valid_data_path is None:
            return "valid_data_path", (
                "required with eval_interval and train_data_path: the validation split's datasets"
            )
    return None


#: The file keys each tokenizer reads.
_TOKENIZER_FILES = {
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "NullTokenizer": (),
}


def check_tokenizer(cfg: TrainConfig) -> Problem:
    """A tokenizer exactly where data files or mock data need one, with its files; the
    vocabulary size given only where no tokenizer gives it."""
    kind = cfg.tokenizer_type
    needs = cfg.uses_data_files or cfg.mock_data
    if needs and kind is None:
        return "tokenizer_type", (
            "is required with data_path or mock_data: HuggingFaceTokenizer (with "
            "tokenizer_model), GPT2BPETokenizer (with vocab_file and merge_file) or NullTokenizer "
            "(with vocab_size)"
        )
    if kind is not None and not needs:
        return "tokenizer_type", (
            "tokenizes data_path or mock_data, and neither is set: set one, or unset "
            "tokenizer_type to train on the synthetic tokens"
        )
    wanted = _TOKENIZER_FILES.get(kind, ())
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        value = getattr(cfg, key)
        if value is not None and key not in wanted:
            return key, f"is read by {_reader_of(key)}, not {kind or 'the synthetic data'}"
        if value is None and key in wanted:
            return key, f"is required with tokenizer_type {kind}"
    gives_vocab = kind in ("HuggingFaceTokenizer", "GPT2BPETokenizer")
    if gives_vocab and cfg.vocab_size is not None:
        return "vocab_size", (
            f"comes from the tokenizer ({kind}, padded to a multiple of "
            "make_vocab_size_divisible_by x TP): unset it"
        )
    if not gives_vocab and cfg.vocab_size is None:
        what = "NullTokenizer" if kind == "NullTokenizer" else "the synthetic data"
        return "vocab_size", f"is required for {what} (token ids below it)"
    return None


def _reader_of(key: str) -> str:
    return next(kind for kind, keys in _TOKENIZER_FILES.items() if key in keys)
