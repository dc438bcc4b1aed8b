"""The synthetic training data: a pure function of the sample index, laid out over
data-parallel ranks as Megatron-LM's pretraining sampler lays out a global batch."""

from __future__ import annotations

import torch

from megatron_dualpipe.megatron.training.data import SyntheticData, sample_tokens

SEQ, VOCAB, MBS = 16, 128, 2


def _data(dp_rank: int, dp_size: int, split: str = "train") -> SyntheticData:
    return SyntheticData(
        seed=7,
        split=split,
        seq_length=SEQ,
        vocab_size=VOCAB,
        micro_batch_size=MBS,
        dp_rank=dp_rank,
        dp_size=dp_size,
        device=torch.device("cpu"),
    )


def test_samples_are_deterministic_tokens_below_the_vocabulary() -> None:
    a = sample_tokens(7, "train", 123, SEQ + 1, VOCAB)
    assert torch.equal(a, sample_tokens(7, "train", 123, SEQ + 1, VOCAB))
    assert not torch.equal(a, sample_tokens(7, "valid", 123, SEQ + 1, VOCAB))
    assert a.dtype == torch.int64 and int(a.min()) >= 0 and int(a.max()) < VOCAB


def test_labels_are_the_tokens_shifted_by_one() -> None:
    batch = _data(0, 1).microbatch(first_sample=40, k=0)
    assert batch["tokens"].shape == batch["labels"].shape == (MBS, SEQ)
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"][1], torch.arange(SEQ))
    assert torch.equal(batch["loss_mask"], torch.ones(MBS, SEQ))


def test_a_global_batch_is_the_same_for_any_data_parallel_size() -> None:
    """Micro-batch k of rank d holds samples first + k*mbs*dp + d*mbs + j."""
    first, global_batch = 64, 8 * MBS
    whole = torch.cat([b["tokens"] for b in _data(0, 1).step(first, global_batch // MBS)])
    for dp in (2, 4):
        rows = {}
        for d in range(dp):
            for k, batch in enumerate(_data(d, dp).step(first, global_batch // (MBS * dp))):
                for j in range(MBS):
                    rows[k * MBS * dp + d * MBS + j] = batch["tokens"][j]
        assert torch.equal(torch.stack([rows[i] for i in range(global_batch)]), whole)
