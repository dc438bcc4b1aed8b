"""The training data by global sample index, read only where a model chunk needs it.

A *sample source* maps a sample index to one sample, a dict of ``tokens``, ``labels`` (the
tokens shifted by one), ``loss_mask``, ``position_ids`` ([seq_length] each) and, where the
source makes one, ``attention_mask`` ([1, seq_length, seq_length], True where masked). Two
kinds:

- Megatron-Core's datasets (``GPTDataset``, ``MockGPTDataset``, their blends; see
  :mod:`.datasets`), which are addressed exactly so;
- :class:`SyntheticSamples` when the config names no data: sample ``i`` of a split is made
  from ``(seed, split, i)`` alone: a noisy arithmetic progression modulo the vocabulary
  (random start, stride 1 to :data:`MAX_STRIDE`, a share :data:`NOISE` of the tokens
  replaced by random ones), so a model can learn it and the loss falls.

A step's global batch is laid out as Megatron-LM's pretraining sampler lays it out:
micro-batch ``k`` of data-parallel rank ``d`` holds samples ``first + k * mbs * dp + d *
mbs + j`` for ``j < mbs``, so any position in the stream (``consumed_train_samples``) can be
resumed without replaying it.

Who reads: a :class:`MicroBatchReader` hands out :class:`PendingMicroBatch` es, which read
their samples only when a model chunk that holds an embedding or a loss asks for them
(:meth:`PendingMicroBatch.for_chunk`); with ``reset_attention_mask`` every chunk needs the
per-document mask, so every chunk reads. Under 1f1b that is the first and the last pipeline
rank, under dualpipev pipeline rank 0 alone (every micro-batch), under dualpipe ranks 0 and
PP-1 (every micro-batch: each feeds one direction's and ends the other's), each chunk only
for the micro-batches whose path passes through it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = [
    "MicroBatch",
    "MicroBatchReader",
    "PendingMicroBatch",
    "SampleSource",
    "SyntheticSamples",
    "sample_tokens",
]

#: Share of tokens replaced by noise, and the largest stride of a progression.
NOISE = 0.1
MAX_STRIDE = 2

MicroBatch = dict[str, torch.Tensor | None]
#: The fields a model chunk's forward step reads.
FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


class SampleSource(Protocol):
    """Samples by global index (Megatron-Core's datasets are such sources)."""

    def __getitem__(self, index: int) -> Mapping[str, Any]: ...


def _sample_seed(seed: int, split: str, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{split}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_tokens(seed: int, split: str, index: int, length: int, vocab_size: int) -> torch.Tensor:
    """Synthetic sample ``index`` of ``split``: ``length`` int64 tokens below ``vocab_size``."""
    generator = torch.Generator().manual_seed(_sample_seed(seed, split, index))
    start = int(torch.randint(vocab_size, (), generator=generator))
    stride = int(
        torch.randint(1, 1 + min(MAX_STRIDE, max(vocab_size - 1, 1)), (), generator=generator)
    )
    tokens = (start + stride * torch.arange(length)) % vocab_size
    noisy = torch.rand(length, generator=generator) < NOISE
    noise = torch.randint(vocab_size, (length,), generator=generator)
    return torch.where(noisy, noise, tokens)


@dataclass(frozen=True)
class SyntheticSamples:
    """The synthetic samples of one split (see the module docstring)."""

    seed: int
    split: str
    seq_length: int
    vocab_size: int

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        text = sample_tokens(self.seed, self.split, index, self.seq_length + 1, self.vocab_size)
        return {
            "tokens": text[:-1].contiguous(),
            "labels": text[1:].contiguous(),
            "loss_mask": torch.ones(self.seq_length),
            "position_ids": torch.arange(self.seq_length),
        }


@dataclass
class MicroBatchReader:
    """The micro-batches data-parallel rank ``dp_rank`` of ``dp_size`` trains on, from
    ``samples`` (None on a rank none of whose chunks reads), on ``device``.
    ``read_samples`` counts the samples read so far."""

    samples: SampleSource | None
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    #: Whether every chunk needs the samples (the per-document attention mask).
    every_chunk_reads: bool = False
    read_samples: int = field(default=0, init=False)

    def indices(self, first_sample: int, k: int) -> range:
        """The global sample indices of micro-batch ``k`` of the step starting at
        ``first_sample`` (Megatron-LM's pretraining sampler's layout)."""
        mbs = self.micro_batch_size
        base = first_sample + k * mbs * self.dp_size + self.dp_rank * mbs
        return range(base, base + mbs)

    def read(self, indices: range) -> MicroBatch:
        """The samples ``indices`` stacked into one micro-batch on the device."""
        if self.samples is None:
            raise RuntimeError(
                "a model chunk asked for data on a rank that builds no dataset (a chunk "
                "without embedding or loss should not read)"
            )
        rows = [self.samples[i] for i in indices]
        self.read_samples += len(rows)
        batch: MicroBatch = {}
        for name in FIELDS:
            if name in rows[0]:
                stacked = torch.stack([torch.as_tensor(row[name]) for row in rows])
                batch[name] = stacked.to(self.device, non_blocking=True)
            else:
                batch[name] = None
        batch["tokens"] = batch["tokens"].long()
        batch["labels"] = batch["labels"].long()
        batch["position_ids"] = batch["position_ids"].long()
        return batch

    def microbatch(self, first_sample: int, k: int) -> MicroBatch:
        """Micro-batch ``k`` of the step whose global batch starts at ``first_sample``, read."""
        return self.read(self.indices(first_sample, k))

    def step(self, first_sample: int, num_microbatches: int) -> list[PendingMicroBatch]:
        """The ``num_microbatches`` micro-batches of one step, in order, not yet read."""
        return [
            PendingMicroBatch(self, self.indices(first_sample, k)) for k in range(num_microbatches)
        ]


@dataclass
class PendingMicroBatch:
    """One micro-batch of a step, read the first time a chunk that needs it asks."""

    reader: MicroBatchReader
    indices: range
    _batch: MicroBatch | None = None

    def for_chunk(self, model: torch.nn.Module) -> MicroBatch:
        """The micro-batch for model chunk ``model`` (a GPTModel, wrappers allowed): read
        where the chunk holds the embedding or the loss (or every chunk needs the mask),
        else every field None."""
        from megatron.core.utils import get_attr_wrapped_model

        ends = get_attr_wrapped_model(model, "pre_process", return_model_obj=True)
        if not (ends.pre_process or ends.post_process or self.reader.every_chunk_reads):
            return dict.fromkeys(FIELDS)
        if self._batch is None:
            self._batch = self.reader.read(self.indices)
        return self._batch
