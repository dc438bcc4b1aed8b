"""``preprocess`` on a corpus of our own, read back by Megatron-Core: each document's ids
with the end-of-document id after it; and every bad input of preprocessing in one sentence,
leaving nothing half-written.

The corpus (120 documents, tests/corpus.py) and a byte-level BPE tokenizer trained on it
with the ``tokenizers`` package are made here, offline; ``preprocess`` writes
``data/corpus_text_document.bin/.idx`` through Megatron-Core's ``IndexedDatasetBuilder``.
``train`` on it: tests/test_megatron_lm_launch.py (the README's data config).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.data.hf_tokenizer import TokenizerError
from megatron_dualpipe.megatron.data.preprocess import PreprocessError, preprocess
from tests.corpus import train_tokenizer, write_corpus

pytestmark = [pytest.mark.megatron]

@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding corpus.jsonl, tokenizer/ and the preprocessed data/."""
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root / "corpus.jsonl")
    train_tokenizer(root / "corpus.jsonl", root / "tokenizer")
    made = preprocess(root / "corpus.jsonl", root / "tokenizer", str(root / "data" / "corpus"))
    (written,) = made.written
    assert written.documents == 120 and written.tokens > 5000
    return root


def test_preprocess_writes_megatrons_indexed_dataset_ending_each_document(corpus: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers import MegatronTokenizer

    dataset = IndexedDataset(str(corpus / "data" / "corpus_text_document"))
    tokenizer = MegatronTokenizer.from_pretrained(
        str(corpus / "tokenizer"), metadata_path={"library": "huggingface"}, use_fast=True
    )
    first = json.loads((corpus / "corpus.jsonl").read_text().splitlines()[0])["text"]
    assert len(dataset) == 120
    assert list(dataset[0]) == [*tokenizer.tokenize(first), tokenizer.eod]


# --------------------------------------------------------------------------------------
# Bad input: one sentence each, before any work, nothing half-written left.


def _one_sentence(err: BaseException, *parts: str) -> str:
    text = str(err)
    assert "\n" not in text and all(p in text for p in parts), text
    return text


BAD_LINES = [
    ('{"text": "fine"}\nnot json at all\n', "line 2: not JSON"),
    ('{"text": "fine"}\n{"body": "no text here"}\n', 'line 2: no "text" field'),
    ('{"text": 7}\n', 'line 1: "text" is int, not a string'),
    ("\n\n", "no documents"),
]


@pytest.mark.parametrize(("content", "message"), BAD_LINES)
def test_a_bad_corpus_is_one_sentence_naming_the_line_and_leaves_nothing(
    corpus: Path, tmp_path: Path, content: str, message: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content, encoding="utf-8")
    with pytest.raises(PreprocessError) as info:
        preprocess(bad, corpus / "tokenizer", str(tmp_path / "out" / "bad"))
    _one_sentence(info.value, str(bad), message)
    assert not list(tmp_path.glob("out/*")), list(tmp_path.glob("out/*"))


def test_a_missing_corpus_or_tokenizer_json_is_one_sentence(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(PreprocessError) as info:
        preprocess(tmp_path / "absent.jsonl", corpus / "tokenizer", str(tmp_path / "x"))
    _one_sentence(info.value, "absent.jsonl does not exist")
    (tmp_path / "hollow").mkdir()
    with pytest.raises(TokenizerError) as info:
        preprocess(corpus / "corpus.jsonl", tmp_path / "hollow", str(tmp_path / "x"))
    _one_sentence(info.value, "--tokenizer", "hollow holds no tokenizer.json")
    assert not list(tmp_path.glob("x*"))
