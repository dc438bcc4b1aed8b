"""``train`` on a corpus of our own: from jsonl through Megatron's indexed dataset to falling
losses, under dualpipev and 1f1b, resumable mid-epoch, with TensorBoard scalars; and every
bad input of preprocessing and of the data keys in one sentence.

The corpus (120 documents, tests/corpus.py) and a byte-level BPE tokenizer trained on it
with the ``tokenizers`` package are made here, offline; ``preprocess`` writes
``data/corpus_text_document.bin/.idx`` through Megatron-Core's ``IndexedDatasetBuilder``;
the runs read it through Megatron-Core's ``GPTDataset`` (configs/tiny_gpt_data.yaml: PP=2,
4 layers, 8 micro-batches of 2 samples of 32 tokens; about 880 samples an epoch, so the
20 iterations, 320 samples, stay within the first epoch and iteration 5 is mid-epoch).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.data.hf_tokenizer import TokenizerError
from megatron_dualpipe.megatron.data.preprocess import PreprocessError, preprocess
from megatron_dualpipe.megatron.training import ConfigError, load_config, train
from tests.corpus import train_tokenizer, write_corpus

pytestmark = [pytest.mark.megatron]

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_data.yaml"


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


def _config(root: Path, *overrides: str):
    return load_config(
        CONFIG,
        [
            f"data_path={root / 'data' / 'corpus_text_document'}",
            f"tokenizer_model={root / 'tokenizer'}",
            f"data_cache_path={root / 'cache'}",
            "output_dir=null",
            "tensorboard_dir=null",
            *overrides,
        ],
    )


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


def test_the_vocabulary_is_the_tokenizers_padded_as_megatron_lm_pads_it(corpus: Path) -> None:
    from megatron_dualpipe.megatron.training.data.tokenizer import build_tokenizer, model_vocab_size

    cfg = _config(corpus)
    tokenizer = build_tokenizer(cfg)
    assert tokenizer.vocab_size == 320 and model_vocab_size(cfg, tokenizer) == 384
    wide = dataclasses.replace(cfg, make_vocab_size_divisible_by=100, tensor_model_parallel_size=2)
    assert model_vocab_size(wide, tokenizer) == 400


def _losses(result) -> list[str]:
    return [f"{result.losses[i]:.6E}" for i in sorted(result.losses)]


@pytest.mark.slow
@pytest.mark.multiproc
def test_dualpipev_and_1f1b_print_the_same_falling_losses_and_tensorboard_reads_back(
    corpus: Path,
) -> None:
    """clip_grad 0: the same digits at every iteration (docs/training.md's table)."""
    board = corpus / "tensorboard"
    boarded = _config(corpus, "clip_grad=0", f"tensorboard_dir={board}")
    dualpipev = train(boarded)
    one_f_one_b = train(_config(corpus, "clip_grad=0", "pipeline_schedule=1f1b"))
    assert len(dualpipev.losses) == 20
    assert _losses(dualpipev) == _losses(one_f_one_b)
    assert dualpipev.validation == one_f_one_b.validation
    assert dualpipev.losses[20] < dualpipev.losses[1] - 1.5, dualpipev.losses
    print(f"\nlosses (dualpipev = 1f1b): {_losses(dualpipev)}")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(boarded.tensorboard_run_dir)  # board/<the run's name>
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {
        "lm loss",
        "lm loss vs samples",
        "learning-rate",
        "batch-size",
        "loss-scale",
        "grad-norm",
        "iteration-time",
        "lm loss validation",
        "lm loss validation ppl",
        "pipeline-bubble/rank-0",
        "pipeline-bubble/rank-1",
        "overlapped-fb-pairs",
    }
    assert expected <= tags, expected - tags
    read = {e.step: e.value for e in events.Scalars("lm loss")}
    assert sorted(read) == list(range(1, 21))
    assert all(math.isclose(read[i], dualpipev.losses[i], rel_tol=1e-6) for i in read)
    assert {e.step: e.value for e in events.Scalars("batch-size")}[20] == 16
    validation = {e.step: e.value for e in events.Scalars("lm loss validation")}
    assert sorted(validation) == [10, 20]
    assert math.isclose(validation[20], dualpipev.validation[20], rel_tol=1e-6)
    bubbles = [e.value for e in events.Scalars("pipeline-bubble/rank-0")]
    assert len(bubbles) == 20 and all(0.0 <= b < 1.0 for b in bubbles)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_resumed_run_reads_the_samples_the_uninterrupted_run_reads(
    corpus: Path, tmp_path: Path
) -> None:
    """Stopped at iteration 5 (mid-epoch) and resumed under 1f1b: the losses of iterations
    6-10 are those of the run that never stopped, as only the same samples give them."""
    whole = train(_config(corpus, "train_iters=10", "clip_grad=0"))
    ckpt = str(tmp_path / "ckpt")
    first = train(
        _config(corpus, "train_iters=10", "clip_grad=0", f"save={ckpt}", "exit_interval=5")
    )
    resumed = train(
        _config(corpus, "train_iters=10", "clip_grad=0", f"load={ckpt}", "pipeline_schedule=1f1b")
    )
    assert sorted(first.losses) == [1, 2, 3, 4, 5] and resumed.resumed_from == 5
    assert [f"{resumed.losses[i]:.6E}" for i in range(6, 11)] == [
        f"{whole.losses[i]:.6E}" for i in range(6, 11)
    ]


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


def test_data_keys_that_cannot_work_are_one_sentence_naming_the_key(corpus: Path) -> None:
    from megatron_dualpipe.megatron.training.data.datasets import check_data_files
    from megatron_dualpipe.megatron.training.data.tokenizer import check_tokenizer_files

    missing = _config(corpus, f"data_path={corpus / 'nothing_text_document'}")
    with pytest.raises(ConfigError) as info:
        check_data_files(missing, "cfg")
    _one_sentence(info.value, "cfg: data_path:", "nothing_text_document.idx does not exist")
    no_tokenizer = _config(corpus, f"tokenizer_model={corpus / 'data'}")
    with pytest.raises(ConfigError) as info:
        check_tokenizer_files(no_tokenizer, "cfg")
    _one_sentence(info.value, "cfg: tokenizer_model:", "holds no tokenizer.json")
    cases = {
        "tokenizer_type=null": "tokenizer_type: is required with data_path",
        "vocab_size=500": "vocab_size: comes from the tokenizer",
        "split=100,0,0": "gives the validation split no documents but eval_interval is set",
        "mock_data=true": "mock_data: replaces data files",
        "recompute_granularity=full": "full needs recompute_method",
        "recompute_modules=mlp": "recompute_modules: applies to recompute_granularity: selective",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as info:
            _config(corpus, override)
        _one_sentence(info.value, message)


def test_recomputation_reaches_megatrons_transformer_config() -> None:
    from megatron_dualpipe.megatron.training.model import transformer_config

    full = load_config(
        CONFIG.with_name("tiny_gpt_cpu.yaml"),
        ["recompute_granularity=full", "recompute_method=block", "recompute_num_layers=2"],
    )
    config = transformer_config(full, on_gpu=False)
    assert (config.recompute_granularity, config.recompute_method) == ("full", "block")
    assert config.recompute_num_layers == 2
    selective = load_config(
        CONFIG.with_name("tiny_gpt_cpu.yaml"),
        ["recompute_granularity=selective", "recompute_modules=core_attn layernorm"],
    )
    assert transformer_config(selective, on_gpu=False).recompute_modules == [
        "core_attn",
        "layernorm",
    ]
