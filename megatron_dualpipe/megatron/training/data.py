"""Deterministic synthetic token data, addressed by global sample index.

Sample ``i`` of a split is generated from ``(seed, split, i)`` alone: a noisy arithmetic
progression modulo the vocabulary (random start, stride 1 to :data:`MAX_STRIDE`, a share
:data:`NOISE` of the tokens replaced by random ones), so a model can learn it and the
loss falls, and any position in the stream can be resumed without replaying it. A step's
global batch is laid out as Megatron-LM's pretraining sampler lays it out: micro-batch
``k`` of data-parallel rank ``d`` holds samples ``first + k * mbs * dp + d * mbs + j`` for
``j < mbs``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

__all__ = ["MicroBatch", "SyntheticData", "sample_tokens"]

#: Share of tokens replaced by noise, and the largest stride of a progression.
NOISE = 0.1
MAX_STRIDE = 2

MicroBatch = dict[str, torch.Tensor]


def _sample_seed(seed: int, split: str, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{split}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_tokens(seed: int, split: str, index: int, length: int, vocab_size: int) -> torch.Tensor:
    """Sample ``index`` of ``split``: ``length`` int64 tokens below ``vocab_size``."""
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
class SyntheticData:
    """The micro-batches data-parallel rank ``dp_rank`` of ``dp_size`` reads.

    Each micro-batch is a dict of ``tokens`` and ``labels`` (the tokens shifted by one),
    ``position_ids`` ([micro_batch_size, seq_length] int64) and ``loss_mask`` (float ones),
    on ``device``.
    """

    seed: int
    split: str
    seq_length: int
    vocab_size: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    device: torch.device

    def microbatch(self, first_sample: int, k: int) -> MicroBatch:
        """Micro-batch ``k`` of the step whose global batch starts at ``first_sample``."""
        mbs = self.micro_batch_size
        base = first_sample + k * mbs * self.dp_size + self.dp_rank * mbs
        text = torch.stack(
            [
                sample_tokens(self.seed, self.split, base + j, self.seq_length + 1, self.vocab_size)
                for j in range(mbs)
            ]
        )
        batch = {
            "tokens": text[:, :-1].contiguous(),
            "labels": text[:, 1:].contiguous(),
            "position_ids": torch.arange(self.seq_length).expand(mbs, -1).contiguous(),
            "loss_mask": torch.ones(mbs, self.seq_length),
        }
        return {name: t.to(self.device, non_blocking=True) for name, t in batch.items()}

    def step(self, first_sample: int, num_microbatches: int) -> list[MicroBatch]:
        """The ``num_microbatches`` micro-batches of one step, in order."""
        return [self.microbatch(first_sample, k) for k in range(num_microbatches)]
