"""``megatron-dualpipe train --dry-run``: each pipeline rank built as
Megatron-LM's ``pretrain()`` builds it (its arguments validated with
``--fake-process-group``, its ``initialize_megatron``, the patched ``get_model``'s builders),
on the meta device (megatron_dualpipe/megatron/lm_dry_run.py).

- Per rank, the parameters it builds are the ones ``pretrain()`` builds in a real run of
  the tiny config, under Megatron's 1F1B and our three schedules (checked beside those runs:
  tests/test_megatron_lm_launch.py); here, only the chosen ranks are built.
- DeepSeek-V3 at full size (configs/deepseek_v3_pp16.yaml, 2,048 ranks) under dualpipe and
  dualpipev: every rank agrees with the memory model and the model without its MTP block is
  DeepSeek's published 671B, in seconds and under a GiB of host memory (slow).
- ``--ranks`` is refused in one sentence where it does not apply (and, on any release,
  without ``--dry-run``, or naming ranks the pipeline lacks).

Each run is a command in a subprocess: the route puts its patched ``megatron.training`` on
the path, which the other tests of the process must not see.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.errors import DualPipeError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_gpt_cpu.yaml"
DEEPSEEK = ROOT / "configs" / "deepseek_v3_pp16.yaml"
#: What the tiny config needs for Megatron-LM's parser (a whole number of minutes).
SETS = ("distributed_timeout_minutes=1",)
BUILT = re.compile(r"^pipeline rank (\d+) \(global rank \d+, built in [\d.]+ s\): ([\d,]+) ", re.M)
pytestmark = pytest.mark.megatron


def _command(config: Path, *flags: str, sets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    items = [arg for item in (*SETS, *sets) for arg in ("--set", item)]
    command = [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(config)]
    command += [*flags, *items]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _dry_run(config: Path, *sets: str, ranks: str | None = None) -> str:
    flags = ["--dry-run", *(["--ranks", ranks] if ranks else [])]
    done = _command(config, *flags, sets=sets)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.route
def test_the_chosen_ranks_only_and_megatron_lm_s_groups() -> None:
    report = _dry_run(TINY, ranks="1")
    assert [r for r, _ in BUILT.findall(report)] == ["1"]
    assert report.startswith("dry run of dualpipev at PP=2 TP=1 EP=1 DP=1 in a fake world of 2")
    assert "pipeline group (Megatron's; carries the lock-step plan) (2)" in report
    assert "communication plan (lock-step, 12 batches on the pipeline group): 32 messages" in report
    assert report.splitlines()[-1].startswith("model parameters, each counted once (of the built")


@pytest.mark.slow
@pytest.mark.parametrize(
    "sets",
    [
        (),
        (
            "pipeline_schedule=dualpipev",
            "decoder_first_pipeline_num_layers=null",
            "decoder_last_pipeline_num_layers=null",
            "pipeline_model_parallel_layout=Et|(tt|)*30,mL",
        ),
    ],
    ids=["dualpipe", "dualpipev"],
)
@pytest.mark.route
def test_deepseek_v3_at_full_size(sets: tuple[str, ...]) -> None:
    report = _dry_run(DEEPSEEK, *sets)
    assert [int(r) for r, _ in BUILT.findall(report)] == list(range(16))
    assert "16 of 16 ranks agree exactly" in report
    # DeepSeek-V3: 671B parameters without the MTP module (the published size).
    assert report.splitlines()[-1] == (
        "model parameters, each counted once: 682,636,472,320 (682.636B); without the MTP "
        "block (11,610,067,968 (11.610B)): 671,026,404,352 (671.026B)"
    )
    took = re.search(
        r"^dry run: 16 ranks in ([\d.]+) s, peak host memory ([\d.]+) GiB", report, re.M
    )
    assert took is not None and float(took[2]) < 2, took
    # Rank 0's four message kinds carry each of the 120 micro-batches once under dualpipev;
    # under dualpipe each direction has half.
    count = 480 if sets else 240
    assert f"{count} messages of 56.0 MiB (bfloat16 4096x1x7168)" in report


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--ranks", "0"], "--ranks chooses the ranks of a dry run: add --dry-run"),
        (["--dry-run", "--ranks", "2"], "--ranks 2: give pipeline ranks between 0 and 1"),
    ],
)
@pytest.mark.route
def test_ranks_that_do_not_apply_are_one_sentence(flags: list[str], said: str) -> None:
    done = _command(TINY, *flags)
    assert done.returncode == 2 and said in done.stderr.splitlines()[-1], done.stderr[-2000:]
    assert "iteration" not in done.stdout


@pytest.mark.route
def test_an_exported_cuda_device_max_connections_at_tp_2_is_one_sentence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Megatron-LM's validate_args asserted 1 with TP > 1 (the CPU view reports a Hopper):
    the dry run says so in one sentence, as ``train`` does."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    sets = ("tensor_model_parallel_size=2", "world_size=4")
    done = _command(TINY, "--dry-run", sets=sets)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].endswith(
        ": CUDA_DEVICE_MAX_CONNECTIONS=8 is exported, and Megatron-LM requires 1 with tensor or "
        "context parallelism (validate_args asserts it on every rank): unset it, or export "
        "CUDA_DEVICE_MAX_CONNECTIONS=1"
    ), done.stderr[-2000:]


@pytest.mark.route
def test_gpu_kernels_of_a_moe_config_build_without_them_on_this_machine(tmp_path: Path) -> None:
    """NVIDIA's MoE configs turn on grouped GEMMs (with ``moe_act`` recomputed, which
    Megatron-Core takes only with them), fused permutation and the flex dispatcher: without
    Transformer Engine the dry run failed in a traceback on each ("Found no NVIDIA driver",
    "install TE >= 2.1.0", "Fake process group is not supported with flex"); it builds the
    same parameters without them, and says so."""
    config = tmp_path / "moe.yaml"
    demo = (ROOT / "configs" / "tiny_moe_cpu.yaml").read_text()
    config.write_text(
        demo.replace("moe_token_dispatcher_type: alltoall", "moe_token_dispatcher_type: flex")
        + "moe_grouped_gemm: true\nmoe_permute_fusion: true\n"
        + "recompute_granularity: selective\nrecompute_modules: [moe_act, core_attn]\n"
    )
    report = _dry_run(config)
    assert "note: built with the alltoall token dispatcher: Megatron-LM's validate_args" in report
    assert "note: built without moe_grouped_gemm and moe_permute_fusion (CUDA kernels" in report
    assert "note: built without moe_act among the recomputed modules" in report
    assert "the memory model and the built modules: 2 of 2 ranks agree exactly" in report


@pytest.mark.route
def test_the_wheel_s_dataset_helpers_are_not_compiled_again(monkeypatch) -> None:
    """Megatron-LM's initialize_megatron has rank 0 run ``make`` in the wheel's
    megatron/core/datasets (no Makefile there: ``sys.exit(1)``), with or without a GPU; the
    route skips it where the compiled helpers import (here ``make`` is not even on PATH)."""
    from megatron.core.datasets import utils

    from megatron_dualpipe.megatron.compat.cpu_compat_training import (
        skip_compiling_shipped_dataset_helpers,
    )

    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)  # put back after
    with pytest.raises(FileNotFoundError):  # the test can fail: without the skip, make runs
        utils.compile_helpers()
    skip_compiling_shipped_dataset_helpers()
    utils.compile_helpers()  # nothing to compile, nothing run


@pytest.mark.parametrize("te_installed", [False, True])
def test_each_layer_kind_is_built_on_the_meta_device(monkeypatch, te_installed: bool) -> None:
    """Megatron-Core's local layers take the build's meta device where they make parameters
    without a device (--use-cpu-initialization); Transformer Engine's are given a device
    (_get_extra_te_kwargs: "cpu" under CPU initialisation, which copies a full CPU master
    weight), so they take --init-model-with-meta-device instead. Nothing is written."""
    from megatron_dualpipe.megatron import lm_dry_run

    monkeypatch.setattr(lm_dry_run, "find_spec", lambda name: object() if te_installed else None)
    given = {"transformer_impl": "transformer_engine", "fp8": "e4m3", "save": "ckpt"}
    out, notes = lm_dry_run._buildable({**given, "load": "ckpt", "async_save": True})
    assert out["perform_initialization"] is False and "save" not in out and "load" not in out
    assert "async_save" not in out
    if te_installed:
        assert out["init_model_with_meta_device"] and "use_cpu_initialization" not in out
        assert out["fp8"] == "e4m3" and "--init-model-with-meta-device" in notes[0]
    else:
        assert out["use_cpu_initialization"] and "init_model_with_meta_device" not in out
        assert out["transformer_impl"] == "local" and "fp8" not in out
    kept, _ = lm_dry_run._buildable({"load": "ckpt", "use_checkpoint_args": True})
    assert kept["load"] == "ckpt"  # the model's arguments are read from it


def test_bad_ranks_are_refused_in_one_sentence() -> None:
    from megatron_dualpipe.megatron.model.built import parse_ranks

    assert parse_ranks("3,1,1", 4) == [1, 3]
    assert parse_ranks(None, 2) == [0, 1]
    for text in ("4", "a", "", "-1"):
        with pytest.raises(DualPipeError, match=r"--ranks .*: give pipeline ranks between 0 and 3"):
            parse_ranks(text, 4)


def test_ranks_need_the_dry_run() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", "--config", str(TINY), "--ranks", "0"])
    assert code != 0
    assert "--ranks chooses the ranks of a dry run: add --dry-run" in err.getvalue()
