"""Megatron-Core's GPT datasets for a training config, as Megatron-LM's pretrain_gpt.py
builds them.

``data_path`` (a blend, split by ``split``), or ``train_data_path`` / ``valid_data_path`` /
``test_data_path`` (one blend per split), or ``mock_data``: a ``GPTDatasetConfig`` from the
same keys Megatron-LM's ``core_gpt_dataset_config_from_args`` reads (seed, sequence length,
blend, split, cache path, ``reset_position_ids``, ``reset_attention_mask``,
``eod_mask_loss``; the attention mask only where ``reset_attention_mask`` asks for one) and
``BlendedMegatronDatasetBuilder(GPTDataset or MockGPTDataset, sizes, is_built_on_rank,
config).build()``. Sizes as Megatron-LM's: ``train_iters x global_batch_size`` training
samples, and ``eval_iters x global_batch_size`` validation samples (every evaluation reads
the same first ``eval_iters`` global batches of the validation split). A dataset holding
fewer samples is repeated in further shuffled epochs, as Megatron-Core does.

Collective: every rank calls :func:`build_datasets` (Megatron-Core's builder synchronises
the ranks while global rank 0 writes the index caches); only ranks with ``builds`` hold a
dataset. :func:`check_data_files` refuses, before any work, what
:func:`~...data.file_checks.data_file_problem` finds in the config's datasets (a missing
``.bin`` or ``.idx``, a pair that is not one indexed dataset, a split that gets no token, a
token id the tokenizer does not have) and a ``data_cache_path`` this process cannot write.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list

from ....writable import unwritable
from ...data.file_checks import data_file_problem
from ..config import DATA_PATH_KEYS, ConfigError, TrainConfig, blame

__all__ = ["build_datasets", "check_data_files", "dataset_prefixes"]


def _blend(words: str | None) -> Any:
    return None if words is None else get_blend_from_list(words.split())


def dataset_prefixes(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(key, prefix) of every indexed dataset the config names."""
    found = []
    for key in DATA_PATH_KEYS:
        blend = _blend(getattr(cfg, key))
        if blend is not None:
            found += [(key, prefix) for prefix in blend[0]]
    return found


def check_data_files(cfg: TrainConfig, source: str, vocabulary: int | None = None) -> None:
    """Refuse, in one sentence naming the key and the file, a dataset prefix without its
    ``.bin`` or ``.idx``, whose ``.idx`` does not index its ``.bin``, of which a split
    with a weight above 0 gets no token (see the module docstring), or holding a token id
    not below ``vocabulary`` (the tokenizer's ``vocab_size``; the ``.bin`` read whole up
    to :data:`~...data.indexed_files.SCAN_BYTES`, else a sample of that size, and not at all
    where its dtype cannot hold such an id); and a ``data_cache_path`` this process cannot
    write Megatron-Core's index caches to."""
    uses_cache = cfg.uses_data_files or cfg.mock_data
    why = unwritable(cfg.data_cache_path) if uses_cache and cfg.data_cache_path else None
    if why is not None:
        raise ConfigError(
            f"{blame(source, 'data_cache_path')}: data_cache_path: "
            f"cannot write to {cfg.data_cache_path} ({why}): "
            "Megatron-Core writes its dataset index caches there: set data_cache_path to a "
            "folder this user can write to"
        )
    prefixes = dataset_prefixes(cfg)
    problem = data_file_problem(
        [(key, prefix) for key, prefix in prefixes if key == "data_path"],
        [(key, prefix) for key, prefix in prefixes if key != "data_path"],
        split=cfg.split,
        vocabulary=vocabulary,
        tokenizer=cfg.tokenizer_type,
        validation_off="unset eval_interval" if cfg.eval_interval else None,
        weighted=(_blend(cfg.data_path) or (None, True))[1] is not None,
        seq_length=cfg.seq_length,
    )
    if problem is not None:
        key, sentence = problem
        raise ConfigError(f"{blame(source, key)}: {sentence}")


def gpt_dataset_config(cfg: TrainConfig, tokenizer: Any) -> GPTDatasetConfig:
    """Megatron-LM's ``core_gpt_dataset_config_from_args`` for ``cfg``."""
    per_split = [_blend(getattr(cfg, key)) for key in DATA_PATH_KEYS[1:]]
    return GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.seq_length,
        blend=_blend(cfg.data_path),
        blend_per_split=per_split if any(per_split) else None,
        split=cfg.split if cfg.data_path is not None or cfg.mock_data else None,
        path_to_cache=cfg.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=cfg.reset_position_ids,
        reset_attention_mask=cfg.reset_attention_mask,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=cfg.reset_attention_mask,
    )


def build_datasets(cfg: TrainConfig, tokenizer: Any, builds: bool) -> tuple[Any, Any]:
    """(training, validation) datasets, None where this rank does not build (``builds``)
    or the split is empty; collective."""
    evaluation = cfg.eval_iters * cfg.global_batch_size if cfg.eval_interval else 0
    sizes = [cfg.train_iters * cfg.global_batch_size, evaluation, 0]
    dataset_class = MockGPTDataset if cfg.mock_data else GPTDataset
    # Megatron-Core logs every index it builds at INFO: keep the training log to our lines.
    logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
    train, valid, _ = BlendedMegatronDatasetBuilder(
        dataset_class, sizes, lambda: builds, gpt_dataset_config(cfg, tokenizer)
    ).build()
    if builds and train is None:
        raise ConfigError(
            f"{cfg.data_path or cfg.train_data_path}: the training split holds no documents: "
            f"give it a weight in split ({cfg.split})"
        )
    return train, valid
