"""``make-tokenizer``: the offline BPE recipe round-trips any text, loads through
Megatron-Core's ``HuggingFaceTokenizer`` as ``preprocess`` and ``train`` load it, reads
the corpus ``preprocess`` reads (or plain text), and refuses in one sentence what cannot
work. (``preprocess`` and ``train`` on it: every real-data test, whose tokenizer
``tests/corpus.py`` makes with this function.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.data.make_tokenizer import make_tokenizer
from megatron_dualpipe.megatron.data.preprocess import PreprocessError, preprocess
from tests.corpus import write_corpus

ROOT = Path(__file__).resolve().parents[1]
#: Text the corpus never shows: other scripts, an emoji, tabs, a blank-ended line.
UNSEEN = ["Grüße aus Köln — 東京 🚀", "tab\tseparated\tvalues", "trailing spaces   ", ""]


def _megatron_tokenizer(directory: Path):
    from megatron_dualpipe.megatron.data.hf_tokenizer import huggingface_tokenizer

    return huggingface_tokenizer(directory, "test")


@pytest.mark.megatron
def test_the_tokenizer_round_trips_any_text_and_loads_in_megatron(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    made = make_tokenizer(corpus, tmp_path / "tok", vocab_size=300)
    assert made.vocab_size == 300 and made.documents == 120
    assert {p.name for p in made.directory.iterdir()} >= {
        "tokenizer.json",
        "tokenizer_config.json",
    }
    tokenizer = _megatron_tokenizer(made.directory)
    assert tokenizer.vocab_size == 300
    assert tokenizer.eod == tokenizer.tokenize("<|endoftext|>")[0]
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:20]]
    for text in texts + UNSEEN:
        ids = tokenizer.tokenize(text)
        assert tokenizer.detokenize(ids) == text
    assert len(tokenizer.tokenize(texts[0])) < len(texts[0].encode()) * 0.7  # merges learned


@pytest.mark.megatron
def test_preprocess_reads_a_corpus_with_the_made_tokenizer(tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=10)
    made = make_tokenizer(corpus, tmp_path / "tok", vocab_size=280)
    (written,) = preprocess(corpus, made.directory, str(tmp_path / "data" / "c")).written
    tokenizer = _megatron_tokenizer(made.directory)
    first = json.loads(corpus.read_text().splitlines()[0])["text"]
    dataset = IndexedDataset(written.prefix)  # alive while its memory map is read
    assert list(dataset[0]) == [*tokenizer.tokenize(first), tokenizer.eod]


def test_a_text_corpus_and_other_keys_are_read(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("one line of text\n\nanother line\n", encoding="utf-8")
    assert make_tokenizer(text, tmp_path / "a", vocab_size=260).documents == 2
    keyed = tmp_path / "keyed.jsonl"
    keyed.write_text('{"body": "x y", "title": "z"}\n', encoding="utf-8")
    made = make_tokenizer(keyed, tmp_path / "b", vocab_size=260, json_keys=["body", "title"])
    assert made.documents == 1


@pytest.mark.parametrize(
    ("content", "options", "message"),
    [
        ('{"text": "a"}\n', {"vocab_size": 100}, "--vocab-size: 100 is below 257"),
        ('{"text": "a"}\n\n{"body": 1}\n', {}, 'line 3: no "text" field'),
        (b'{"text": "a"}\n{"text": "\xff"}\n', {}, "line 2: not UTF-8 text"),
        ("\n\n", {}, "holds no document (every line is blank)"),
    ],
)
def test_bad_input_is_one_sentence(
    tmp_path: Path, content: str | bytes, options: dict, message: str
) -> None:
    corpus = tmp_path / "c.jsonl"
    if isinstance(content, bytes):
        corpus.write_bytes(content)
    else:
        corpus.write_text(content, encoding="utf-8")
    with pytest.raises(PreprocessError) as info:
        make_tokenizer(corpus, tmp_path / "tok", **{"vocab_size": 300, **options})
    assert message in str(info.value) and "\n" not in str(info.value), info.value
    assert not (tmp_path / "tok").exists()


def test_an_existing_tokenizer_is_not_overwritten(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", documents=5)
    make_tokenizer(corpus, tmp_path / "tok", vocab_size=260)
    before = (tmp_path / "tok" / "tokenizer.json").read_bytes()
    with pytest.raises(PreprocessError) as info:
        make_tokenizer(corpus, tmp_path / "tok", vocab_size=270)
    assert f"--output: {tmp_path / 'tok'} already holds a tokenizer" in str(info.value)
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == before


def test_the_command_says_where_to_use_it(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", documents=5)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dualpipe", "make-tokenizer", "--input", str(corpus),
         "--output", str(tmp_path / "tok"), "--vocab-size", "270"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        f"wrote {tmp_path / 'tok'}: a byte-level BPE of 270 tokens trained on 5 documents, "
        f"end-of-document token <|endoftext|>; use it with preprocess --tokenizer "
        f"{tmp_path / 'tok'} and train's tokenizer_model: {tmp_path / 'tok'}\n"
    )
