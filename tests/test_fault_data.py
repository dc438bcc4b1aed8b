"""Data files that cannot train are one sentence before any rank starts: a split that
Megatron-Core's rounding leaves without a document (its ``GPTDataset._get_num_epochs``
loops for ever on it: at PP=2 the run ended at ``distributed_timeout_minutes`` blaming a
dead rank, at ``world_size`` 1 it never ended), and a ``.idx`` that does not index its
``.bin`` (another corpus's, truncated, random: it trained on the wrong document boundaries,
or failed after the ranks started with a traceback).

Corpora of 120, 2 and 1 documents (tests/corpus.py) are preprocessed here with one
tokenizer. Runs that would hang are bounded: in-process runs by the config's one-minute
``distributed_timeout_minutes``, the one-rank run as a subprocess killed after 120 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_dualpipe.megatron.data.preprocess import preprocess
from megatron_dualpipe.megatron.training import ConfigError, load_config, train
from tests.corpus import train_tokenizer, write_corpus
from tests.processes import OUR_LOOP

pytestmark = [pytest.mark.megatron]

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_gpt_data.yaml"


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


def _sets(root: Path, documents: int, *more: str) -> list[str]:
    return [
        f"data_path={_prefix(root, documents)}",
        f"tokenizer_model={root / 'tokenizer'}",
        f"data_cache_path={root / 'cache'}",
        "output_dir=null",
        "tensorboard_dir=null",
        "train_iters=3",
        *more,
    ]


def _refused(root: Path, documents: int, *more: str) -> str:
    cfg = load_config(CONFIG, _sets(root, documents, *more))
    with pytest.raises(ConfigError) as info:
        train(cfg, source="cfg")
    return str(info.value)


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


@pytest.mark.multiproc  # before the refusal, the ranks started (and hung)
@pytest.mark.parametrize(
    ("documents", "more", "message"),
    [
        (
            120,
            ("split=969,30,1",),
            "cfg: split: 969,30,1 gives the test split 0 of the 120 documents of {prefix} (0.10% "
            "of them, rounded by Megatron-Core to documents 120 to 120; 0 tokens), and "
            "Megatron-Core's GPTDataset loops for ever on a split without tokens: set its weight "
            "to 0 (split: 969,30,0), or a corpus of at least 1,001 documents",
        ),
        (
            2,
            (),
            "cfg: split: 90,10,0 gives the valid split 0 of the 2 documents of {prefix} (10.00% "
            "of them, rounded by Megatron-Core to documents 2 to 2; 0 tokens), and Megatron-Core's "
            "GPTDataset loops for ever on a split without tokens: set its weight to 0 (split: "
            "90,0,0) and unset eval_interval, or a corpus of at least 11 documents",
        ),
        (
            1,
            ("eval_interval=null", "split=1,1,0"),
            "cfg: split: 1,1,0 gives the train split 0 of the 1 documents of {prefix} (50.00% "
            "of them, rounded by Megatron-Core to documents 0 to 0; 0 tokens), and Megatron-Core's "
            "GPTDataset loops for ever on a split without tokens: a corpus of at least 3 "
            "documents",
        ),
    ],
    ids=["default split, 120 documents", "90,10,0, 2 documents", "1,1,0, 1 document"],
)
def test_a_split_without_documents_is_refused_before_any_rank_starts(
    corpora: Path, documents: int, more: tuple[str, ...], message: str
) -> None:
    assert _refused(corpora, documents, *more) == message.format(prefix=_prefix(corpora, documents))


@pytest.mark.slow
def test_a_one_rank_run_on_a_split_without_documents_ends_in_one_sentence(corpora: Path) -> None:
    """world_size 1 never ended: no peer's timeout stops the rank's loop."""
    one_rank = ["world_size=1", "pipeline_model_parallel_size=1", "pipeline_schedule=1f1b"]
    sets = _sets(corpora, 120, "split=969,30,1", *one_rank)
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(CONFIG), *OUR_LOOP,
         *(arg for item in sets for arg in ("--set", item))],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("train on a split without documents ran past 120 s (it hangs)")
    assert proc.returncode == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("megatron-dualpipe: error: "), err
    assert "split: 969,30,1 gives the test split 0 of the 120 documents of " in last, err
    assert "Traceback" not in err, err


def test_a_per_split_dataset_without_tokens_is_refused(corpora: Path, tmp_path: Path) -> None:
    """An index of no document (Megatron-Core's writer makes one from an empty corpus)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    empty = str(tmp_path / "empty_text_document")
    IndexedDatasetBuilder(empty + ".bin", dtype=np.uint16).finalize(empty + ".idx")
    message = _refused(
        corpora, 120, "data_path=null", f"train_data_path={empty}", "eval_interval=null"
    )
    assert message == (
        f"cfg: train_data_path: {empty} holds no tokens (0 documents), and Megatron-Core's "
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
        f"cfg: data_path: {prefix}.idx and {prefix}.bin are not one indexed dataset ({why}): "
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
    """Checked from the files alone (the launcher's pre-flight calls this check)."""
    from megatron_dualpipe.megatron.training.data.datasets import check_data_files

    prefix, why = _damaged(corpora, tmp_path, damage)
    cfg = load_config(CONFIG, _sets(corpora, 120, f"data_path={prefix}", "split=90,10,0"))
    with pytest.raises(ConfigError) as info:
        check_data_files(cfg, "cfg")
    assert str(info.value) == _not_one_dataset(prefix, why)


@pytest.mark.multiproc
def test_a_bin_with_another_corpus_idx_does_not_train(corpora: Path, tmp_path: Path) -> None:
    """It trained, exit 0, on a third of the data read at the wrong document boundaries."""
    prefix, why = _damaged(corpora, tmp_path, "another corpus's .idx")
    assert _refused(corpora, 120, f"data_path={prefix}", "split=90,10,0") == _not_one_dataset(
        prefix, why
    )


def test_the_genuine_pair_passes(corpora: Path, tmp_path: Path) -> None:
    from megatron_dualpipe.megatron.training.data.datasets import check_data_files

    prefix = _pair(corpora, tmp_path)
    check_data_files(load_config(CONFIG, _sets(corpora, 120, f"data_path={prefix}")), "cfg")


# -- token ids and the tokenizer -----------------------------------------------------------


def test_token_ids_beyond_the_tokenizers_vocabulary_are_refused(corpora: Path) -> None:
    """The corpus's tokenizer has 320 ids; a NullTokenizer of 100 (101 with its
    end-of-document id) failed in the embedding after the ranks started."""
    from megatron_dualpipe.megatron.data.indexed_files import largest_token, read_index

    prefix = _prefix(corpora, 120)
    largest, whole = largest_token(prefix, read_index(prefix).dtype)
    assert whole and 100 < largest < 320
    from megatron_dualpipe.megatron.training.data.tokenizer import build_tokenizer

    null = ["tokenizer_type=NullTokenizer", "tokenizer_model=null", "vocab_size=100"]
    # 101 in 0.16.1 (its end-of-document id after the 100), 100 in 0.19.
    ids = build_tokenizer(load_config(CONFIG, _sets(corpora, 120, *null))).vocab_size
    assert ids in (100, 101)
    assert _refused(corpora, 120, "split=90,10,0", *null) == (
        f"cfg: data_path: {prefix}.bin holds token id {largest:,}, beyond the {ids} ids of the "
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


def test_a_tokenizer_without_an_end_of_document_token_is_refused(
    corpora: Path, tmp_path: Path
) -> None:
    """preprocess refused it; train failed after the ranks started."""
    import json

    tokenizer = tmp_path / "no-eos"
    shutil.copytree(corpora / "tokenizer", tokenizer)
    config = tokenizer / "tokenizer_config.json"
    settings = json.loads(config.read_text(encoding="utf-8"))
    settings.pop("eos_token", None)
    config.write_text(json.dumps(settings), encoding="utf-8")
    (tokenizer / "special_tokens_map.json").unlink(missing_ok=True)
    message = _refused(corpora, 120, "split=90,10,0", f"tokenizer_model={tokenizer}")
    assert message == (
        f"cfg: tokenizer_model: {tokenizer} has no end-of-document token (eos_token in "
        "tokenizer_config.json): add one, Megatron appends it to every document"
    )


# -- folders train writes into -------------------------------------------------------------


@pytest.mark.parametrize("key", ["data_cache_path", "tensorboard_dir"])
def test_an_unwritable_folder_is_refused(corpora: Path, tmp_path: Path, key: str) -> None:
    """A folder under a file (root may write anywhere, so no permission bits): Megatron-Core's
    message named an internal attribute, TensorBoard's writer an os.makedirs traceback."""
    (tmp_path / "a-file").write_text("x", encoding="utf-8")
    folder = tmp_path / "a-file" / "sub"
    message = _refused(corpora, 120, "split=90,10,0", f"{key}={folder}", "run_name=null")
    what = (
        "Megatron-Core writes its dataset index caches there: set data_cache_path to a folder "
        "this user can write to"
        if key == "data_cache_path"
        else "set tensorboard_dir to a folder this user can write to, or unset it"
    )
    assert message == f"cfg: {key}: cannot write to {folder} (Not a directory): {what}"


# -- whom an error blames ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data_path={missing}", "data_path: {missing}.idx does not exist: name each dataset"),
        ("tokenizer_model={missing}", "tokenizer_model: {missing} does not exist: point it at"),
        ("transformer_impl=transformer_engine", "transformer_impl: transformer_engine needs"),
        ("fp8=hybrid", "fp8: FP8 training runs through Transformer Engine's layers"),
    ],
    ids=["data_path", "tokenizer_model", "transformer_impl", "fp8"],
)
def test_a_key_given_with_set_is_blamed_on_its_set(
    corpora: Path, tmp_path: Path, override: str, message: str
) -> None:
    """These were blamed on the YAML file ("tiny_gpt_data.yaml: data_path: ...")."""
    from megatron_dualpipe.megatron.training.config import config_source

    missing = str(tmp_path / "missing")
    item = override.format(missing=missing)
    sets = [*_sets(corpora, 120, "split=90,10,0"), item]
    with pytest.raises(ConfigError) as info:
        train(load_config(CONFIG, sets), source=config_source(CONFIG, sets))
    assert str(info.value).startswith(f"--set {item}: {message.format(missing=missing)}")


# -- resuming on other data ----------------------------------------------------------------


@pytest.mark.slow  # three short runs
def test_resuming_on_other_data_says_so_once(corpora: Path, tmp_path: Path) -> None:
    """It said nothing; the checkpoint now records the data keys (not a refusal)."""
    save = tmp_path / "ckpt"
    first = ["split=90,10,0", "train_iters=2", "lr_warmup_iters=1", "eval_interval=null"]
    first.append(f"save={save}")
    train(load_config(CONFIG, _sets(corpora, 120, *first)), source="cfg")
    again = ["train_iters=3", "override_opt_param_scheduler=true", f"load={save}", "save=null"]
    same = train(load_config(CONFIG, _sets(corpora, 120, *first, *again)), source="cfg")
    assert not [line for line in same.lines if "note:" in line]
    other = _pair(corpora, tmp_path)
    moved = _sets(corpora, 120, *first, *again, f"data_path={other}")
    lines = train(load_config(CONFIG, moved), source="cfg").lines
    notes = [line for line in lines if "note:" in line]
    assert notes == [
        f" note: {save}/iter_0000002 was saved by a run reading other data or another "
        f"tokenizer (data_path {_prefix(corpora, 120)!r}, now {other!r}): this run goes on "
        "from its weights on what the config names now"
    ]
