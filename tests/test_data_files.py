"""Data files that cannot train are one sentence (``megatron.data.file_checks``, which
``train`` runs before any rank starts): a split that Megatron-Core's rounding leaves without
a document (its ``GPTDataset._get_num_epochs`` loops for ever on it: at PP=2 a run ended at
``distributed_timeout_minutes`` blaming a dead rank, at ``world_size`` 1 it never ended), a
dataset without tokens, and a ``.idx`` that does not index its ``.bin`` (another corpus's,
truncated, random: a run trained on the wrong document boundaries, or failed after the ranks
started with a traceback). ``train``'s refusals of them: tests/test_megatron_lm_launch.py.

Corpora of 120, 2 and 1 documents (tests/corpus.py) are preprocessed here with one
tokenizer.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron_dualpipe.megatron.data.file_checks import data_file_problem
from megatron_dualpipe.megatron.data.preprocess import preprocess
from tests.corpus import train_tokenizer, write_corpus

pytestmark = [pytest.mark.megatron]



@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with tokenizer/ and data/c<N>_text_document for N = 120, 2 and 1."""
    root = tmp_path_factory.mktemp("corpora")
    train_tokenizer(write_corpus(root / "c120.jsonl"), root / "tokenizer")
    for documents in (120, 2, 1):
        corpus = root / f"c{documents}.jsonl"
        write_corpus(corpus, documents)
        made = preprocess(corpus, root / "tokenizer", str(root / "data" / f"c{documents}"))
        assert made.written[0].documents == documents
    return root


def _prefix(root: Path, documents: int) -> str:
    return str(root / "data" / f"c{documents}_text_document")


def _problem(key: str, prefix: str, split: str | None = "90,10,0", **more: object) -> str:
    """The sentence refusing the dataset at ``prefix`` under ``key`` (data_path, split by
    ``split``; else a per-split key)."""
    blend = [(key, prefix)] if key == "data_path" else []
    whole = [] if key == "data_path" else [(key, prefix)]
    problem = data_file_problem(blend, whole, split=split, **more)  # type: ignore[arg-type]
    assert problem is not None and problem[0] == key
    assert "\n" not in problem[1]
    return problem[1]


# -- a split without documents -------------------------------------------------------------


def test_megatrons_split_arithmetic_is_reproduced() -> None:
    """The documented default on 120 documents: 116 train, 4 valid, none for the test split
    (Megatron-Core's builder rounds 0.999 x 120 = 119.88 to 120)."""
    from megatron_dualpipe.megatron.data.indexed_files import split_ranges

    assert split_ranges("969,30,1", 120) == [
        ("train", 0.969, range(0, 116)),
        ("valid", 0.03, range(116, 120)),
        ("test", 0.001, range(120, 120)),
    ]
    assert split_ranges("90,10,0", 2)[1:] == [("valid", 0.1, range(2, 2)), None]


@pytest.mark.parametrize(
    ("documents", "split", "validation_off", "message"),
    [
        (
            120,
            "969,30,1",
            None,
            "split: 969,30,1 gives the test split 0 of the 120 documents of {prefix} (0.10% "
            "of them, rounded by Megatron-Core to documents 120 to 120; 0 tokens), and "
            "Megatron-Core's GPTDataset loops for ever on a split without tokens: set its weight "
            "to 0 (split: 969,30,0), or a corpus of at least 1,001 documents",
        ),
        (
            2,
            "90,10,0",
            "set eval_iters: 0",
            "split: 90,10,0 gives the valid split 0 of the 2 documents of {prefix} (10.00% "
            "of them, rounded by Megatron-Core to documents 2 to 2; 0 tokens), and Megatron-Core's "
            "GPTDataset loops for ever on a split without tokens: set its weight to 0 (split: "
            "90,0,0) and set eval_iters: 0, or a corpus of at least 11 documents",
        ),
        (
            1,
            "1,1,0",
            None,
            "split: 1,1,0 gives the train split 0 of the 1 documents of {prefix} (50.00% "
            "of them, rounded by Megatron-Core to documents 0 to 0; 0 tokens), and Megatron-Core's "
            "GPTDataset loops for ever on a split without tokens: a corpus of at least 3 "
            "documents",
        ),
    ],
    ids=["default split, 120 documents", "90,10,0, 2 documents", "1,1,0, 1 document"],
)
def test_a_split_without_documents_is_refused(
    corpora: Path, documents: int, split: str, validation_off: str | None, message: str
) -> None:
    prefix = _prefix(corpora, documents)
    said = _problem("data_path", prefix, split, validation_off=validation_off)
    assert said == message.format(prefix=prefix)


def test_a_per_split_dataset_without_tokens_is_refused(corpora: Path, tmp_path: Path) -> None:
    """An index of no document (Megatron-Core's writer makes one from an empty corpus)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    empty = str(tmp_path / "empty_text_document")
    IndexedDatasetBuilder(empty + ".bin", dtype=np.uint16).finalize(empty + ".idx")
    assert _problem("train_data_path", empty, split=None) == (
        f"train_data_path: {empty} holds no tokens (0 documents), and Megatron-Core's "
        "GPTDataset loops for ever on a dataset without tokens: preprocess a corpus with text "
        "into it, or leave it out of train_data_path"
    )


# -- a .idx that does not index its .bin ---------------------------------------------------


def _pair(corpora: Path, tmp_path: Path, documents: int = 120) -> str:
    """A copy of a corpus's .bin and .idx under tmp_path; returns its prefix."""
    prefix = str(tmp_path / "copy_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copyfile(_prefix(corpora, documents) + suffix, prefix + suffix)
    return prefix


def _not_one_dataset(prefix: str, why: str) -> str:
    return (
        f"data_path: {prefix}.idx and {prefix}.bin are not one indexed dataset ({why}): "
        "write both again from the corpus with megatron-dualpipe preprocess (or Megatron-LM's "
        "tools/preprocess_data.py), and name the prefix they share"
    )


def _truncate(path: str, keep: int) -> None:
    with open(path, "r+b") as stream:
        stream.truncate(keep)


def _rewrite(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as stream:
        stream.seek(offset)
        stream.write(data)


#: The .idx header: magic (9 bytes), version, dtype code, sequence and index counts.
_LENGTHS_AT = 34


def _damaged(corpora: Path, tmp_path: Path, damage: str) -> tuple[str, str]:
    """A damaged copy of the 120-document pair and the clause its refusal must give."""
    prefix = _pair(corpora, tmp_path)
    idx, binary = prefix + ".idx", prefix + ".bin"
    bin_size = Path(binary).stat().st_size
    tokens = bin_size // 2  # uint16 tokens
    idx_size = Path(idx).stat().st_size
    if damage == "another corpus's .idx":
        shutil.copyfile(_prefix(corpora, 2) + ".idx", idx)
        small = Path(_prefix(corpora, 2) + ".bin").stat().st_size
        return prefix, (
            f"the .idx counts {small // 2:,} tokens of uint16 ({small:,} bytes) but the .bin "
            f"holds {bin_size:,} bytes"
        )
    if damage == "a truncated .bin":
        _truncate(binary, 1000)
        return prefix, (
            f"the .idx counts {tokens:,} tokens of uint16 ({bin_size:,} bytes) but the .bin "
            "holds 1,000 bytes"
        )
    if damage == "a truncated .idx":
        _truncate(idx, 500)
        return prefix, (
            f"the .idx holds 500 bytes, but its header's 120 sequences and 121 document-index "
            f"entries take {idx_size:,}"
        )
    if damage == "a random .idx":
        Path(idx).write_bytes(np.random.default_rng(0).bytes(idx_size))
        return prefix, "the .idx does not begin with Megatron's index magic b'MMIDIDX\\x00\\x00'"
    if damage == "a random .bin of another length":
        Path(binary).write_bytes(np.random.default_rng(0).bytes(bin_size + 3))
        return prefix, (
            f"the .idx counts {tokens:,} tokens of uint16 ({bin_size:,} bytes) but the .bin "
            f"holds {bin_size + 3:,} bytes"
        )
    if damage == "another version":
        _rewrite(idx, 9, struct.pack("<Q", 2))
        return prefix, "the .idx is of version 2, not 1"
    if damage == "an unknown dtype":
        _rewrite(idx, 17, struct.pack("<B", 99))
        return prefix, "the .idx names token dtype code 99, not one of Megatron-Core's"
    if damage == "a sequence pointer moved":
        _rewrite(idx, _LENGTHS_AT + 120 * 4 + 5 * 8, struct.pack("<q", 12))
        lengths = np.fromfile(idx, np.int32, 120, offset=_LENGTHS_AT)
        return prefix, (
            f"the .idx puts sequence 5 at byte 12 of the .bin, where the sequences before it "
            f"end at byte {int(lengths[:5].sum()) * 2:,}"
        )
    assert damage == "a document index going back"
    _rewrite(idx, _LENGTHS_AT + 120 * 12 + 3 * 8, struct.pack("<q", 1))
    return prefix, "the .idx's document index goes back at entry 3 (2 then 1)"


DAMAGES = [
    "another corpus's .idx",
    "a truncated .bin",
    "a truncated .idx",
    "a random .idx",
    "a random .bin of another length",
    "another version",
    "an unknown dtype",
    "a sequence pointer moved",
    "a document index going back",
]


@pytest.mark.parametrize("damage", DAMAGES)
def test_an_idx_that_does_not_index_its_bin_is_refused(
    corpora: Path, tmp_path: Path, damage: str
) -> None:
    """Checked from the files alone (it trained, exit 0, on another corpus's .idx: a third of
    the data read at the wrong document boundaries)."""
    prefix, why = _damaged(corpora, tmp_path, damage)
    assert _problem("data_path", prefix) == _not_one_dataset(prefix, why)


def test_the_genuine_pair_passes(corpora: Path, tmp_path: Path) -> None:
    prefix = _pair(corpora, tmp_path)
    assert data_file_problem([("data_path", prefix)], [], split="969,30,0", vocabulary=320) is None


# -- token ids and the tokenizer -----------------------------------------------------------


def test_token_ids_beyond_the_tokenizers_vocabulary_are_refused(corpora: Path) -> None:
    """The corpus's tokenizer has 320 ids; a NullTokenizer of 100 (101 with its
    end-of-document id) failed in the embedding after the ranks started."""
    from megatron_dualpipe.megatron.data.indexed_files import largest_token, read_index

    prefix = _prefix(corpora, 120)
    largest, whole = largest_token(prefix, read_index(prefix).dtype)
    assert whole and 100 < largest < 320
    assert _problem("data_path", prefix, vocabulary=101, tokenizer="NullTokenizer") == (
        f"data_path: {prefix}.bin holds token id {largest:,}, beyond the 101 ids of the "
        "tokenizer (NullTokenizer): train with the tokenizer that wrote it, or preprocess the "
        "corpus again with this one"
    )


def test_the_largest_token_of_a_large_bin_is_read_from_a_bounded_sample(tmp_path: Path) -> None:
    from megatron_dualpipe.megatron.data.indexed_files import largest_token

    tokens = np.zeros(1 << 24, dtype=np.uint16)  # 32 MiB: two 16 MiB windows
    tokens[5] = 7
    tokens[-1] = 9
    tokens[len(tokens) // 2 + 10] = 11  # past the one window of a 16 MiB sample
    tokens.tofile(tmp_path / "x.bin")
    assert largest_token(str(tmp_path / "x"), np.dtype(np.uint16)) == (11, True)
    assert largest_token(str(tmp_path / "x"), np.dtype(np.uint16), budget=1 << 25) == (11, True)
    assert largest_token(str(tmp_path / "x"), np.dtype(np.uint16), budget=1 << 24) == (7, False)
