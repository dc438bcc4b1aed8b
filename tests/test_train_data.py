"""The training data: samples by global index (synthetic ones a pure function of the index),
laid out over data-parallel ranks as Megatron-LM's pretraining sampler lays out a global
batch, and read only where a model chunk holds the embedding or the loss."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_dualpipe.megatron.training.data.samples import (
    MicroBatchReader,
    SyntheticSamples,
    sample_tokens,
)

SEQ, VOCAB, MBS = 16, 128, 2


def _reader(dp_rank: int, dp_size: int, split: str = "train", **kw) -> MicroBatchReader:
    return MicroBatchReader(
        SyntheticSamples(7, split, SEQ, VOCAB),
        micro_batch_size=MBS,
        dp_rank=dp_rank,
        dp_size=dp_size,
        device=torch.device("cpu"),
        **kw,
    )


def test_samples_are_deterministic_tokens_below_the_vocabulary() -> None:
    a = sample_tokens(7, "train", 123, SEQ + 1, VOCAB)
    assert torch.equal(a, sample_tokens(7, "train", 123, SEQ + 1, VOCAB))
    assert not torch.equal(a, sample_tokens(7, "valid", 123, SEQ + 1, VOCAB))
    assert a.dtype == torch.int64 and int(a.min()) >= 0 and int(a.max()) < VOCAB


def test_labels_are_the_tokens_shifted_by_one() -> None:
    batch = _reader(0, 1).microbatch(first_sample=40, k=0)
    assert batch["tokens"].shape == batch["labels"].shape == (MBS, SEQ)
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"][1], torch.arange(SEQ))
    assert torch.equal(batch["loss_mask"], torch.ones(MBS, SEQ))
    assert batch["attention_mask"] is None  # causal: no mask is made


def test_a_global_batch_is_the_same_for_any_data_parallel_size() -> None:
    """Micro-batch k of rank d holds samples first + k*mbs*dp + d*mbs + j."""
    first, global_batch = 64, 8 * MBS
    whole = torch.cat(
        [_reader(0, 1).microbatch(first, k)["tokens"] for k in range(global_batch // MBS)]
    )
    for dp in (2, 4):
        rows = {}
        for d in range(dp):
            reader = _reader(d, dp)
            for k in range(global_batch // (MBS * dp)):
                batch = reader.microbatch(first, k)
                for j in range(MBS):
                    rows[k * MBS * dp + d * MBS + j] = batch["tokens"][j]
        assert torch.equal(torch.stack([rows[i] for i in range(global_batch)]), whole)


def _chunk(pre: bool, post: bool) -> SimpleNamespace:
    return SimpleNamespace(pre_process=pre, post_process=post)


def test_only_chunks_with_an_embedding_or_a_loss_read_and_each_reads_once() -> None:
    reader = _reader(0, 1)
    pending = reader.step(first_sample=0, num_microbatches=4)
    middle = pending[0].for_chunk(_chunk(False, False))
    assert all(value is None for value in middle.values()) and reader.read_samples == 0
    first = pending[0].for_chunk(_chunk(True, False))
    last = pending[0].for_chunk(_chunk(False, True))  # dualpipev's rank 0 holds both ends
    assert first is last and reader.read_samples == MBS
    assert torch.equal(first["tokens"], reader.microbatch(0, 0)["tokens"])


def test_a_per_document_mask_makes_every_chunk_read() -> None:
    reader = _reader(0, 1, every_chunk_reads=True)
    batch = reader.step(0, 1)[0].for_chunk(_chunk(False, False))
    assert batch["tokens"] is not None and reader.read_samples == MBS


def test_a_rank_without_a_dataset_refuses_to_read() -> None:
    reader = MicroBatchReader(None, MBS, 0, 1, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="builds no dataset"):
        reader.step(0, 1)[0].for_chunk(_chunk(True, False))
