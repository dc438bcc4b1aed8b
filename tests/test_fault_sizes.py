"""Sizes no run can hold are refused in one sentence before any work: a step with more
micro-batches than megatron-dualpipe builds a schedule for (the bound ``simulate`` keeps),
a step whose micro-batches do not fit in this machine's memory, integers beyond what
Megatron-Core and torch take, and split counts beyond the model.

Before, ``--set global_batch_size=1000000000`` printed the parameter counts and then each
rank grew by 18 MB/s until it was killed; ``num_layers: 10**30`` was a 38-line traceback.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.megatron.training import ConfigError, load_config, train
from tests.processes import OUR_LOOP

pytestmark = pytest.mark.megatron

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"


def test_a_runaway_global_batch_size_is_refused_before_any_rank_starts(capsys) -> None:
    started = time.monotonic()
    code = main(
        ["train", "--config", str(TINY), *OUR_LOOP, "--set", "global_batch_size=1000000000"]
    )
    assert code == 2 and time.monotonic() - started < 5.0
    assert capsys.readouterr().err == (
        "megatron-dualpipe: error: --set global_batch_size=1000000000: global_batch_size: "
        "1000000000 makes 500000000 micro-batches per step (global_batch_size / "
        "(micro_batch_size x data-parallel size)), and PP=2 x 500000000 micro-batches is too "
        "large a step to build on each rank (about 2980.2 GB and 100000 s before the first "
        "step, at 3.2 KB and 0.1 ms per PP x micro-batch): train builds PP x micro-batches up "
        "to 300,000 (about 1 GB and 30 s): lower global_batch_size to at most 300,000 here, or "
        "raise micro_batch_size\n"
    )


def test_the_issues_global_batch_size_at_the_old_bound_is_refused(capsys) -> None:
    """2,000,000 (PP=2 x 1,000,000 micro-batches) was exactly the old bound and ran away:
    no output after the parameter counts, 35 MB/s per rank, 6.8 GB at 190 s. The bound is
    now what bench/step_build.py measured a rank to need (3.1 KB a PP x micro-batch)."""
    code = main(["train", "--config", str(TINY), *OUR_LOOP, "--set", "global_batch_size=2000000"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "PP=2 x 1000000 micro-batches is too large a step to build on each rank (about " in err
    assert "6.0 GB and 200 s" in err and "lower global_batch_size to at most 300,000 here" in err


def test_a_step_at_the_bound_passes_the_size_check_and_one_above_does_not() -> None:
    load_config(TINY, ["global_batch_size=300000"])  # PP=2 x 150,000: accepted
    with pytest.raises(ConfigError, match="PP=2 x 150001 micro-batches is too large"):
        load_config(TINY, ["global_batch_size=300002"])


def test_a_step_that_takes_seconds_to_build_is_announced() -> None:
    from megatron_dualpipe.megatron.training.loop import _build_notice

    assert _build_notice(load_config(TINY)) is None  # 8 micro-batches: at once
    assert _build_notice(load_config(TINY, ["global_batch_size=40000"])) == (
        " building the dualpipev step for PP=2 x 20,000 micro-batches on every rank before "
        "the first iteration: about 4 s and 122 MB each"
    )
    megatrons = load_config(TINY, ["global_batch_size=40000", "pipeline_schedule=1f1b"])
    assert _build_notice(megatrons) is None  # Megatron-Core's own schedule: nothing to build


def test_a_step_whose_micro_batches_do_not_fit_in_memory_is_refused() -> None:
    cfg = load_config(TINY, ["seq_length=1000000", "global_batch_size=200000"])
    with pytest.raises(ConfigError) as info:
        train(cfg, source="cfg.yaml")
    assert re.fullmatch(
        r"cfg\.yaml: global_batch_size: a step's 100000 micro-batches of 2 x 1000000 tokens "
        r"take 5215\.6 GiB of input on each of the 2 ranks here, beyond half of this "
        r"machine's \d+ GiB: lower global_batch_size \(or seq_length\)",
        str(info.value),
    ), info.value


def test_an_integer_beyond_a_c_int_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    text = TINY.read_text(encoding="utf-8").replace("num_layers: 8", "num_layers: " + "1" * 31)
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: num_layers: must be at most 2,147,483,647, got "
        "1,111,111,111,111,111,111,111,111,111,111"
    )


def test_first_stage_layers_beyond_num_layers_say_so() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["decoder_first_pipeline_num_layers=20"])
    assert str(info.value) == (
        "--set decoder_first_pipeline_num_layers=20: decoder_first_pipeline_num_layers: "
        "dualpipev at PP=2 runs 4 model stages: the first/last stage layer counts (20) exceed "
        "num_layers (8): lower them, or raise num_layers"
    )


def test_a_dataset_index_that_does_not_fit_in_memory_is_refused() -> None:
    """Megatron-Core's GPT dataset indexes train_iters x global_batch_size samples."""
    sets = ["mock_data=true", "tokenizer_type=NullTokenizer", "train_iters=2000000000"]
    with pytest.raises(ConfigError) as info:
        train(load_config(TINY, sets), source="cfg.yaml")
    assert re.fullmatch(
        r"cfg\.yaml: train_iters: 2000000000 steps of 16 samples make Megatron-Core's dataset "
        r"index 32,000,000,000 samples long, about 715 GiB on each of the 2 ranks here, beyond "
        r"half of this machine's \d+ GiB: lower train_iters \(or global_batch_size\)",
        str(info.value),
    ), info.value
