"""``megatron-dualpipe train``: a YAML config's keys as Megatron-LM's
flags, and the config trained by Megatron-LM's own ``pretrain()``.

The key-to-flag rules run against a parser with the kinds of argument Megatron-LM's
``arguments.py`` declares (megatron-core 0.19): ``--no-persist-layer-norm`` is a
``store_true`` whose argument is ``no_persist_layer_norm``, ``--no-bias-gelu-fusion`` a
``store_false`` of ``bias_gelu_fusion``, ``--data-path`` takes ``nargs='*'``,
``--distributed-timeout-minutes`` an int, a few are ``BooleanOptionalAction``. The runs
(slow, megatron-core 0.19's wheel) fork two CPU ranks through the command itself.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.lm_args import (
    OTHER_WAY,
    MegatronLMConfigError,
    megatron_lm_argv,
)
from megatron_dualpipe.megatron.lm_launch import megatron_lm_run_argv
from tests.multiproc import run_workers

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_gpt_cpu.yaml"


def _parser() -> argparse.ArgumentParser:
    """Megatron-LM's kinds of argument, one or two of each (and what CPU_SETTINGS name)."""
    p = argparse.ArgumentParser(prog="pretrain", allow_abbrev=False, exit_on_error=False)
    for flag in ("--num-layers", "--seq-length", "--max-position-embeddings"):
        p.add_argument(flag, type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--distributed-timeout-minutes", type=int, default=10)
    p.add_argument("--transformer-impl", default="transformer_engine")
    p.add_argument("--distributed-backend", default="nccl")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--mock-data", action="store_true")
    p.add_argument("--data-path", nargs="*")
    p.add_argument("--no-persist-layer-norm", action="store_true")
    p.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                   dest="gradient_accumulation_fusion")  # fmt: skip
    for fused in ("bias-gelu", "bias-dropout", "masked-softmax"):
        p.add_argument(f"--no-{fused}-fusion", action="store_false",
                       dest=f"{fused.replace('-', '_')}_fusion")  # fmt: skip
    p.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion")
    p.add_argument("--data-args-path")
    p.add_argument("--moe-layer-freq", default=1)
    p.add_argument("--inference-wandb-logging", action=argparse.BooleanOptionalAction)
    p.add_argument("--pipeline-schedule", choices=("1f1b", "dualpipev"))
    return p


def test_each_key_becomes_its_flag() -> None:
    settings = {"num_layers": 8, "lr": 3.0e-3, "data_path": [1, "corpus"], "world_size": 2}
    assert megatron_lm_argv(settings, _parser(), "c.yaml") == [
        *("--num-layers", "8", "--lr", "0.003", "--data-path", "1", "corpus"),
    ]  # world_size is the launcher's


def test_a_yaml_float_without_a_dot_reaches_megatron_lm_as_a_number(tmp_path: Path) -> None:
    """YAML 1.1 reads ``1e-3`` as a string (no dot): Megatron-LM's parser gets the text and
    reads the number."""
    from megatron_dualpipe.schedules.config_values import read_values

    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-3\n", encoding="utf-8")
    argv = megatron_lm_argv(read_values(path), _parser(), "c.yaml")
    assert argv == ["--lr", "1e-3"] and _parser().parse_args(argv).lr == 1e-3


def test_the_writer_queue_is_made_for_the_rank_s_own_torch_dist_saves_only() -> None:
    """Megatron-LM's torch_dist save spawns its results-queue manager on the first save;
    --async-save's worker keeps a queue of its own, other formats none."""
    from megatron_dualpipe.megatron.lm_launch import _saves_torch_dist_here

    def parsed(**given: object) -> argparse.Namespace:  # Megatron-LM 0.19's defaults
        return argparse.Namespace(**{"save": None, "ckpt_format": "torch_dist",
                                     "async_save": False, "use_persistent_ckpt_worker": False,
                                     **given})  # fmt: skip

    assert _saves_torch_dist_here(parsed(save="ck"))
    assert not _saves_torch_dist_here(parsed(load="ck"))
    assert not _saves_torch_dist_here(parsed(save="ck", ckpt_format="torch"))
    assert not _saves_torch_dist_here(
        parsed(save="ck", async_save=True, use_persistent_ckpt_worker=True)
    )
    # validate_args turns --async-save off without the persistent worker: the rank saves
    assert _saves_torch_dist_here(parsed(save="ck", async_save=True))


def test_true_and_false_pick_the_flag_that_stores_them() -> None:
    p = _parser()
    assert megatron_lm_argv({"bf16": True, "bias_gelu_fusion": False}, p, "c") == [
        "--bf16",
        "--no-bias-gelu-fusion",
    ]
    assert megatron_lm_argv({"no_persist_layer_norm": True}, p, "c") == ["--no-persist-layer-norm"]
    assert megatron_lm_argv({"inference_wandb_logging": False}, p, "c") == [
        "--no-inference-wandb-logging"
    ]
    # Megatron-LM's default already, with no flag to write it: nothing.
    assert megatron_lm_argv({"bf16": False, "bias_gelu_fusion": True, "lr": None}, p, "c") == []


def test_a_key_megatron_lm_lacks_is_named_with_the_nearest() -> None:
    with pytest.raises(MegatronLMConfigError) as info:
        megatron_lm_argv({"num_layer": 8}, _parser(), "c.yaml")
    assert str(info.value) == (
        "c.yaml: num_layer is not an argument of Megatron-LM's pretrain (did you mean "
        "'num_layers'?): write a Megatron-LM flag in snake case, or remove it"
    )


def test_a_key_megatron_lm_names_otherwise_is_refused_naming_its_name() -> None:
    p = _parser()
    p.add_argument("--num-virtual-stages-per-pipeline-rank", type=int)
    with pytest.raises(MegatronLMConfigError) as info:
        megatron_lm_argv({"virtual_pipeline_model_parallel_size": 2}, p, "c.yaml")
    assert str(info.value) == (
        "c.yaml: virtual_pipeline_model_parallel_size is not an argument of Megatron-LM's "
        "pretrain (did you mean 'num_virtual_stages_per_pipeline_rank'?): write a Megatron-LM "
        "flag in snake case, or remove it"
    )


def test_a_key_the_route_does_another_way_says_how() -> None:
    """optimize_schedule: the route's way is profile, simulate --optimize, schedule file
    (run end to end in tests/test_profile_trace.py)."""
    with pytest.raises(MegatronLMConfigError) as info:
        megatron_lm_argv({"optimize_schedule": True}, _parser(), "c.yaml")
    assert str(info.value) == f"c.yaml: optimize_schedule: {OTHER_WAY['optimize_schedule']}"
    assert "--save ORDER) and train it with pipeline_schedule_file: ORDER" in str(info.value)


def test_a_key_the_route_does_another_way_is_left_out_when_off() -> None:
    assert megatron_lm_argv({"optimize_schedule": False, "lr": 0.1}, _parser(), "c.yaml") == [
        "--lr",
        "0.1",
    ]


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"profile_step_start": 3, "profile_step_end": 3}, "profile_step_end 3 is not after "),
        ({"train_iters": 4, "profile_step_end": 6}, "profile_step_end 6 is past train_iters 4"),
        ({"tensorboard_dir": None}, "profile with use_pytorch_profiler writes its traces into "),
        ({"use_pytorch_profiler": False}, "profile without use_pytorch_profiler starts CUDA's "),
    ],
)
def test_a_profile_megatron_lm_would_not_write_is_one_sentence(given: dict, said: str) -> None:
    """Megatron-LM's torch profiler: its window in order and within the run (it stops at
    iteration profile_step_end only), and a tensorboard_dir beside which the traces go."""
    from megatron_dualpipe.megatron.lm_launch import _check_profile

    args = dict(profile=True, use_pytorch_profiler=True, profile_step_start=1)
    args |= dict(profile_step_end=2, train_iters=10, tensorboard_dir="tb") | given
    with pytest.raises(MegatronLMConfigError, match=f"^x.yaml: {re.escape(said)}") as refused:
        _check_profile(argparse.Namespace(**args), "x.yaml", on_cpu=True)
    assert str(refused.value).count(": ") >= 2  # what is wrong: what to change
    _check_profile(argparse.Namespace(**{**args, "profile": False}), "x.yaml", on_cpu=True)
    if "use_pytorch_profiler" in given:  # nsys's profiler where CUDA is
        _check_profile(argparse.Namespace(**args), "x.yaml", on_cpu=False)


@pytest.mark.parametrize(
    "given",
    [{"name": key} for key in ("moe_grouped_gemm", "moe_permute_fusion", "tp_comm_overlap",
     "use_torch_fsdp2", "use_megatron_fsdp", "enable_cuda_graph", "external_cuda_graph")]
    + [{"moe_token_dispatcher_type": "flex"},
       {"sequence_parallel": True, "tensor_model_parallel_size": 2},
       {"log_memory_to_tensorboard": True, "tensorboard_dir": "tb"},
       {"cuda_graph_impl": "transformer_engine"}, {"cuda_graph_impl": "local"}],
    ids=lambda given: given.get("name") or "-".join(map(str, next(iter(given.items())))),
)  # fmt: skip
def test_what_needs_cuda_is_refused_on_cpu_ranks_in_one_sentence(given: dict) -> None:
    """Each failed on CPU ranks ("Cannot re-initialize CUDA in forked subprocess", "install
    TE >= 2.1.0", "DeepEP is not installed", "sequence parallel not supported by torch
    LayerNorm", a KeyError from torch.cuda.memory_stats() on the TensorBoard writer's rank,
    Megatron-FSDP's CUDA device; CUDA graphs were refused by each rank once started)."""
    from megatron_dualpipe.megatron.lm_launch import CUDA_ONLY, _check_cuda_only

    name = given.get("name")
    args = argparse.Namespace(**({name: True} if name else given))
    with pytest.raises(MegatronLMConfigError) as refused:
        _check_cuda_only(args, "x.yaml")
    said = str(refused.value)
    if name:
        assert said == f"x.yaml: {name} needs {CUDA_ONLY[name]}, which CPU ranks have not: " + (
            f"set {name}: false here"
        )
    else:
        assert said.startswith(f"x.yaml: {next(iter(given))} ") and said.endswith(" here")
    for harmless in (
        {"moe_token_dispatcher_type": "alltoall"},
        {"sequence_parallel": True, "tensor_model_parallel_size": 1},  # Megatron turns it off
        {"log_memory_to_tensorboard": True, "tensorboard_dir": None},  # no writer: no read
        {"cuda_graph_impl": "none"},
    ):
        _check_cuda_only(argparse.Namespace(**harmless), "x.yaml")


def test_an_exported_cuda_device_max_connections_megatron_asserts_against_is_one_sentence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TP > 1 with CUDA_DEVICE_MAX_CONNECTIONS=8 exported: Megatron-LM's validate_args
    asserted on every CPU rank (this project's CPU view reports a Hopper); 1, unset, the
    all-to-all overlap (which wants more queues) or FSDP (Megatron-LM warns) pass."""
    from megatron_dualpipe.megatron.lm_launch import _check_cuda_only, check_max_connections

    tp2 = argparse.Namespace(tensor_model_parallel_size=2)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with pytest.raises(MegatronLMConfigError) as refused:
        _check_cuda_only(tp2, "x.yaml")
    assert str(refused.value) == (
        "x.yaml: CUDA_DEVICE_MAX_CONNECTIONS=8 is exported, and Megatron-LM requires 1 with "
        "tensor or context parallelism (validate_args asserts it on every rank): unset it, or "
        "export CUDA_DEVICE_MAX_CONNECTIONS=1"
    )
    with pytest.raises(MegatronLMConfigError):
        _check_cuda_only(argparse.Namespace(context_parallel_size=2), "x.yaml")
    _check_cuda_only(argparse.Namespace(tensor_model_parallel_size=1), "x.yaml")
    overlapped = {"tensor_model_parallel_size": 2, "overlap_moe_expert_parallel_comm": True}
    _check_cuda_only(argparse.Namespace(**overlapped), "x.yaml")
    for fsdp in ("use_torch_fsdp2", "use_megatron_fsdp"):  # Megatron-LM only warns
        check_max_connections(argparse.Namespace(tensor_model_parallel_size=2, **{fsdp: True}), "x")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    _check_cuda_only(tp2, "x.yaml")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    _check_cuda_only(tp2, "x.yaml")


@pytest.mark.megatron
@pytest.mark.route
def test_cuda_s_memory_statistics_on_cpu_ranks_are_refused_before_any_rank() -> None:
    """Through :func:`checked_run_argv` (Megatron-LM's parser): before any rank."""
    from megatron_dualpipe.megatron.lm_launch import checked_run_argv, patched_training

    settings = {"train_iters": 3, "eval_interval": 3, "log_memory_to_tensorboard": True}
    settings["tensorboard_dir"] = "tb"
    with patched_training(), pytest.raises(MegatronLMConfigError, match="^x.yaml: log_memory"):
        checked_run_argv(settings, "x.yaml", on_cpu=True)


#: A run saving asynchronously with the persistent worker and Megatron-Core's own strategy.
ASYNC = dict(async_save=True, use_persistent_ckpt_worker=True, async_strategy="mcore")


def _async_save_refusal(*, on_cpu: bool, **given: object) -> str | None:
    """What :func:`_check_async_save` says of :data:`ASYNC` changed by ``given``."""
    from megatron_dualpipe.megatron.lm_launch import _check_async_save

    try:
        _check_async_save(argparse.Namespace(**{**ASYNC, **given}), "x.yaml", on_cpu=on_cpu)
    except MegatronLMConfigError as refused:
        return str(refused)
    return None


def test_an_asynchronous_save_that_cannot_run_on_cpu_ranks_is_one_sentence() -> None:
    """The persistent checkpoint worker selects a CUDA device as it starts: on CPU ranks it
    died and the first save waited on it for ever (a run killed at its 300 s timeout).
    Without the worker Megatron-LM saves from the rank, and that is left alone."""
    assert _async_save_refusal(on_cpu=True) == (
        "x.yaml: async_save with use_persistent_ckpt_worker cannot run on CPU ranks: "
        "Megatron-Core's persistent checkpoint worker selects a CUDA device as it starts, "
        "fails without one, and the ranks would wait on it for ever: set async_save: false "
        "here (saves are then synchronous)"
    )
    assert _async_save_refusal(on_cpu=True, use_persistent_ckpt_worker=False) is None
    assert _async_save_refusal(on_cpu=True, async_save=False) is None
    assert _async_save_refusal(on_cpu=False) is None  # Megatron-Core's strategy on a GPU


def test_an_asynchronous_save_of_a_format_megatron_lm_cannot_save_so_is_one_sentence() -> None:
    """Megatron-LM keeps async_save on for its legacy format (``torch``) and for any format
    with the persistent worker; its save_checkpoint then raised NotImplementedError at the
    first save on every rank. Without a save it never does."""
    legacy = dict(ckpt_format="torch", save="ck", use_persistent_ckpt_worker=False)
    assert _async_save_refusal(on_cpu=False, **legacy) == (
        "x.yaml: async_save cannot save ckpt_format torch (Megatron-LM's save_checkpoint "
        "refuses it at the first save, on every rank): set ckpt_format to one of torch_dist, "
        "torch_dcp, fsdp_dtensor, or async_save: false"
    )
    assert _async_save_refusal(on_cpu=False, **{**legacy, "use_persistent_ckpt_worker": True})
    assert _async_save_refusal(on_cpu=False, **{**legacy, "save": None}) is None
    # a distributed format without the worker: Megatron-LM turns async_save off
    assert _async_save_refusal(on_cpu=False, **{**legacy, "ckpt_format": "torch_dist"}) is None


@pytest.mark.megatron
@pytest.mark.route
def test_an_asynchronous_save_without_nvidia_resiliency_ext_is_one_sentence() -> None:
    """Megatron-LM's default ``async_strategy`` (nvrx) needs nvidia-resiliency-ext, which
    0.19's wheel does not bring (every rank stopped in a traceback)."""
    from megatron.core.dist_checkpointing.strategies.nvrx import has_nvrx_async_support

    if has_nvrx_async_support():
        pytest.skip("nvidia-resiliency-ext is installed here")
    assert _async_save_refusal(on_cpu=False, async_strategy="nvrx") == (
        "x.yaml: async_save with async_strategy nvrx (Megatron-LM's default) needs "
        "nvidia-resiliency-ext's asynchronous checkpointing, which is not installed: "
        "pip install nvidia-resiliency-ext, or set async_strategy: mcore"
    )


def test_the_intervals_megatron_lm_needs_are_one_sentence() -> None:
    """Megatron-LM 0.19 asserts a save_interval with save (a bare AssertionError on every
    rank), and divides the iterations by eval_interval (a TypeError, or a ZeroDivisionError,
    on every rank) unless the run validates fully or trains nothing and resumes nothing."""
    from megatron_dualpipe.megatron.lm_launch import _check_intervals

    args = dict(save=None, save_interval=None, save_retain_interval=None, eval_interval=5)
    args |= dict(load=None, full_validation=False, skip_train=False)
    for given, said in [
        ({"eval_interval": None}, "eval_interval is None, and Megatron-LM's pretrain() divides "
         "the training iterations by it to size the validation data (an error on every rank): "
         "set eval_interval above 0, e.g. to train_iters (eval_iters: 0 validates nothing)"),
        ({"eval_interval": 0}, "eval_interval is 0, "),
        ({"eval_interval": None, "skip_train": True, "load": "ck"}, "eval_interval is None, "),
        ({"save": "ckpt"}, "save is set and save_interval is None, and Megatron-LM's "
         "pretrain() saves every save_interval iterations (its validate_args asserts one above "
         "0): set save_interval, e.g. to train_iters (it also saves at the end and at "
         "exit_interval)"),
        ({"save": "ckpt", "save_interval": 0}, "save is set and save_interval is 0, "),
        ({"save": "ckpt", "save_interval": 4, "save_retain_interval": 6},
         "save_retain_interval 6 is not a positive multiple of save_interval 4 "),
    ]:  # fmt: skip
        with pytest.raises(MegatronLMConfigError) as refused:
            _check_intervals(argparse.Namespace(**(args | given)), "x.yaml")
        assert str(refused.value).startswith(f"x.yaml: {said}")
    fine = [
        {},
        {"eval_interval": None, "full_validation": True},
        {"eval_interval": None, "skip_train": True},
        {"save": "ckpt", "save_interval": 3, "save_retain_interval": 6},
    ]
    for given in fine:
        _check_intervals(argparse.Namespace(**(args | given)), "x.yaml")


def test_the_launcher_builds_no_tokenizer_that_would_run_code_or_download(tmp_path: Path) -> None:
    """trust_remote_code, or a tokenizer file not on disk (a Hugging Face hub name): the
    token ids are left to the ranks."""
    from megatron_dualpipe.megatron.lm_launch import _vocabulary

    base = dict(tokenizer_type="HuggingFaceTokenizer", vocab_file=None, merge_file=None)
    remote = argparse.Namespace(**base, tokenizer_model=str(tmp_path), trust_remote_code=True)
    hub = argparse.Namespace(**base, tokenizer_model="org/model", trust_remote_code=False)
    for args in (remote, hub):
        assert _vocabulary(args) == (None, "HuggingFaceTokenizer")


def test_a_switch_given_a_number_is_refused() -> None:
    with pytest.raises(MegatronLMConfigError, match=r"^c: bf16 is a switch of Megatron-LM "):
        megatron_lm_argv({"bf16": 1}, _parser(), "c")


#: What the CPU settings write, in order.
CPU_LINE = [
    "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
    "--no-rope-fusion", "--distributed-backend", "gloo",
]  # fmt: skip


def test_the_run_s_line_cpu_settings_mock_data_and_positions() -> None:
    argv, parsed = megatron_lm_run_argv({"seq_length": 16}, _parser(), "c", on_cpu=True)
    assert (parsed.max_position_embeddings, parsed.mock_data) == (16, True)
    positions = ["--mock-data", "--max-position-embeddings", "16"]
    assert argv == [*CPU_LINE, "--seq-length", "16", *positions]
    # A key the config sets wins over the CPU settings, a switch's true included.
    settings = {"transformer_impl": "transformer_engine", "masked_softmax_fusion": True}
    argv, _ = megatron_lm_run_argv(settings, _parser(), "c", on_cpu=True)
    assert "local" not in argv and "--no-masked-softmax-fusion" not in argv
    assert argv[:2] == ["--transformer-impl", "transformer_engine"]


@pytest.mark.parametrize(
    "data", [{"data_path": ["corpus"]}, {"data_args_path": "blend.txt"}, {"mock_data": False}]
)
def test_a_data_key_given_takes_no_mock_data(data: dict) -> None:
    """A blend file (``data_args_path``) used to get mock data on top, which
    ``MockGPTDataset`` then trained on; ``mock_data: false`` could not turn it off."""
    argv, _ = megatron_lm_run_argv(data, _parser(), "c", on_cpu=False)
    assert "--mock-data" not in argv


def test_a_list_for_a_flag_of_one_value_is_one_sentence() -> None:
    with pytest.raises(MegatronLMConfigError) as info:
        megatron_lm_run_argv({"moe_layer_freq": [1, 0, 1]}, _parser(), "c", on_cpu=False)
    assert str(info.value) == (
        "c: moe_layer_freq takes one value (--moe-layer-freq), not a list: write the list as "
        'one string, as on Megatron-LM\'s command line (e.g. "[1,0,1]")'
    )
    argv, _ = megatron_lm_run_argv({"moe_layer_freq": "[1,0,1]"}, _parser(), "c", on_cpu=False)
    assert argv == ["--moe-layer-freq", "[1,0,1]", "--mock-data"]


def test_a_value_megatron_lm_s_parser_rejects_is_one_sentence() -> None:
    with pytest.raises(MegatronLMConfigError) as info:
        megatron_lm_run_argv({"distributed_timeout_minutes": 0.5}, _parser(), "c", on_cpu=True)
    assert str(info.value) == (
        "c: argument --distributed-timeout-minutes: invalid int value: '0.5': give it a value "
        "Megatron-LM's parser takes"
    )


# Runs of the command: Megatron-LM's pretrain() on two forked CPU ranks.

LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: (\d\.\d{6}E[-+]\d\d) \|.* grad norm: ")
VALIDATION = re.compile(r"validation loss at iteration (\d+) on validation set \| lm loss value: "
                        r"(\d\.\d{6}E[-+]\d\d)")  # fmt: skip
#: Three steps, a validation after the last; no dropout (Megatron-LM seeds it per rank);
#: the config's clipping on (it clips at every step here).
def test_the_save_folder_is_held_for_the_run_by_its_holder_only(tmp_path: Path) -> None:
    """One run per save folder: within the run the holder (the forking command, or global
    rank 0) holds ``--save``'s lock, which another run cannot take; another rank holds
    nothing; after the run the lock is free again."""
    from megatron_dualpipe.megatron.checkpoint.lock import SaveDirectoryInUse, save_lock
    from megatron_dualpipe.megatron.lm_launch import _one_run_per_save

    save = tmp_path / "ck"
    parsed = argparse.Namespace(save=str(save), load=None)
    in_use = pytest.raises(SaveDirectoryInUse, match=f"^save: {save} is in use by another run")
    with _one_run_per_save(parsed, holder=True), in_use, save_lock(save):
        pass
    with _one_run_per_save(parsed, holder=False), save_lock(save):
        pass  # the lock was given back, and a rank that does not hold takes none


def test_another_run_s_complete_checkpoints_in_save_are_refused(tmp_path: Path) -> None:
    """A save folder holding another run's complete checkpoints that this run does not
    load: one sentence, and the lock is given back; loading that folder is resuming it."""
    from megatron_dualpipe.megatron.checkpoint.files import CheckpointError
    from megatron_dualpipe.megatron.checkpoint.lock import save_lock
    from megatron_dualpipe.megatron.lm_launch import _one_run_per_save
    from tests.test_checkpoint_trust import _checkpoint

    save = tmp_path / "ck"
    _checkpoint(save / "iter_0000002")
    (save / "iter_0000004").mkdir()  # what a killed save leaves: not complete
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    fresh = argparse.Namespace(save=str(save), load=None)
    with pytest.raises(CheckpointError) as refused, _one_run_per_save(fresh, holder=True):
        pytest.fail("the run went on")
    assert str(refused.value) == (
        f"save: {save} holds complete checkpoints of another run (iteration 2) and this run "
        f"does not load from it, so its saves would overwrite them: resume that run with "
        f"load: {save} (load and save one folder), or choose another save"
    )
    with save_lock(save):
        pass
    with _one_run_per_save(argparse.Namespace(save=str(save), load=str(save)), holder=True):
        pass
    elsewhere = argparse.Namespace(save=str(save), load=str(tmp_path / "other"))
    loads_elsewhere = f"and this run loads from {tmp_path / 'other'}, so"
    with (
        pytest.raises(CheckpointError, match=loads_elsewhere),
        _one_run_per_save(elsewhere, holder=True),
    ):
        pytest.fail("the run went on")
    (save / "iter_0000002" / "metadata.json").unlink()  # only incomplete ones left
    with _one_run_per_save(fresh, holder=True):
        pass  # overwritten, as Megatron-LM's dist_checkpointing does


@pytest.mark.parametrize("key", ["save", "data_cache_path", "tensorboard_dir"])
def test_a_folder_the_run_would_write_that_cannot_be_written_is_one_sentence(
    tmp_path: Path, key: str
) -> None:
    """Megatron-LM finds an unwritable --save at its first save (after the iterations before
    it): the launcher tries each folder the run writes first; a writable one is made."""
    from megatron_dualpipe.megatron.lm_launch import WRITTEN_FOLDERS, check_folders

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    good = {name: str(tmp_path / name) for name in WRITTEN_FOLDERS}
    with pytest.raises(MegatronLMConfigError) as refused:
        check_folders(argparse.Namespace(**{**good, key: f"{blocker}/sub"}), "x.yaml")
    assert str(refused.value) == (
        f"x.yaml: {key}: cannot write to {blocker}/sub (Not a directory): set {key} to a "
        "folder this user can write to"
    )
    check_folders(argparse.Namespace(**good), "x.yaml")
    assert all(Path(folder).is_dir() for folder in good.values())


SETS = (
    "train_iters=3", "eval_interval=3", "eval_iters=1", "hidden_dropout=0",
    "attention_dropout=0", "distributed_timeout_minutes=1",
)  # fmt: skip


def _command(*sets: str) -> list[str]:
    """``train`` of the tiny config with :data:`SETS` and ``sets``."""
    items = [arg for item in (*SETS, *sets) for arg in ("--set", item)]
    command = [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(TINY)]
    return [*command, *items]


def _train(*sets: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*sets), cwd=ROOT, capture_output=True, text=True, timeout=600)


#: Megatron-LM's default, set over the tiny config's untied embeddings.
TIED = "untie_embeddings_and_output_weights=false"


@functools.cache
def _trained(schedule: str, *sets: str) -> subprocess.CompletedProcess:
    """The tiny config trained from scratch under ``schedule``, tied, with ``sets``: one run
    that every test comparing against it reads (it saves nothing, and the same flags print
    the same digits)."""
    return _train(f"pipeline_schedule={schedule}", TIED, *sets)


def _refused(*sets: str) -> str:
    """The last line of a :func:`_train` that refused before any rank (exit 2, nothing
    trained)."""
    done = _train(*sets)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "iteration" not in done.stdout
    return done.stderr.splitlines()[-1]


#: Megatron-LM's get_model, once per pipeline rank at data-parallel rank 0; and the dry run's
#: line of each rank it builds.
PRETRAIN_BUILT = re.compile(
    r"number of parameters on \(tensor, gtp_weight_remat, pipeline\) model parallel rank "
    r"\(0, 0, (\d+)\): (\d+)"
)
DRY_RUN_BUILT = re.compile(
    r"^pipeline rank (\d+) \(global rank \d+, built in [\d.]+ s\): ([\d,]+) ", re.M
)


@functools.cache
def _dry_run_built(*sets: str) -> dict[int, int]:
    """Parameters per pipeline rank of the tiny config, as ``--dry-run`` builds them."""
    done = subprocess.run(
        [*_command(*sets), "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 of 2 ranks agree exactly" in done.stdout  # with the memory model
    return {int(r): int(n.replace(",", "")) for r, n in DRY_RUN_BUILT.findall(done.stdout)}


def _megatron_core_0_19() -> bool:
    from megatron_dualpipe.megatron.compat.version import megatron_lm_tag

    return megatron_lm_tag() == "core_v0.19.0"


def _printed(done: subprocess.CompletedProcess) -> tuple[dict[str, str], dict[str, str]]:
    """A finished run's training and validation losses by iteration (3 and the last)."""
    assert done.returncode == 0, done.stderr[-3000:]
    losses, validation = dict(LOSS.findall(done.stdout)), dict(VALIDATION.findall(done.stdout))
    assert sorted(losses) == ["1", "2", "3"] and sorted(validation) == ["3"], done.stdout
    return losses, validation


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.route
@pytest.mark.parametrize("schedule", ["1f1b", "zb1p", "dualpipev", "dualpipe"])
def test_the_tiny_config_trains_as_1f1b_under_each_schedule(schedule: str) -> None:
    """From scratch, tied embeddings (Megatron-LM's default, set over the config's untied
    ones): zb1p and dualpipev print 1F1B's digits, dualpipe within a millionth; ``--dry-run``
    builds on each rank the parameters Megatron-LM's ``get_model`` says it built, under each
    placement (zb1p places the layers as 1F1B does: its get_model is held to 1F1B's dry run).
    dualpipe's last rank used to copy its zeroed output layer over its embedding (loss 4.863
    against 4.876 at step 1, then barely learning)."""
    done = _trained(schedule)
    printed = _printed(done)
    built = {int(r): int(n) for r, n in PRETRAIN_BUILT.findall(done.stdout)}
    placed_as = "1f1b" if schedule == "zb1p" else schedule
    assert built == _dry_run_built(f"pipeline_schedule={placed_as}", TIED)  # cached
    said = "Megatron's own" if schedule == "1f1b" else f"{schedule} (megatron-dualpipe's)"
    assert f"pipeline schedule: {said}" in done.stdout + done.stderr
    megatrons = _printed(_trained("1f1b"))
    if schedule != "dualpipe":
        assert printed == megatrons
        return
    for got, want in zip(printed, megatrons, strict=True):
        for step, loss in want.items():
            assert float(got[step]) == pytest.approx(float(loss), rel=1e-6), (step, got, want)


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.route
@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_tensor_parallel_ranks_train_as_1f1b(schedule: str) -> None:
    """TP=2 x PP=2 on four CPU ranks, from scratch: dualpipev prints 1F1B's digits, and
    ``--dry-run`` builds the parameters Megatron-LM's ``get_model`` built. Megatron-LM's
    validate_args asks the device's architecture with TP > 1: on CPU ranks that was torch's
    "Cannot re-initialize CUDA in forked subprocess" on every rank (the dry run: "Found no
    NVIDIA driver")."""
    sets = ("tensor_model_parallel_size=2", "world_size=4")
    done = _trained(schedule, *sets)
    printed = _printed(done)
    built = {int(r): int(n) for r, n in PRETRAIN_BUILT.findall(done.stdout)}
    assert built == _dry_run_built(f"pipeline_schedule={schedule}", TIED, *sets)
    assert printed == _printed(_trained("1f1b", *sets))


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.route
def test_the_readme_s_main_job_runs_megatron_lm_s_loop_where_0_19_is_installed() -> None:
    """``train --config configs/tiny_gpt_cpu.yaml`` (shortened): Megatron-LM's
    ``pretrain()`` builds the model, dualpipev runs it, and it learns."""
    sets = ("train_iters=3", "eval_interval=3", "eval_iters=1")
    command = [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(TINY)]
    command += [arg for item in sets for arg in ("--set", item)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(int(r) for r, _ in PRETRAIN_BUILT.findall(done.stdout)) == [0, 1]
    assert "pipeline schedule: dualpipev (megatron-dualpipe's)" in done.stdout + done.stderr
    losses = {int(step): float(loss) for step, loss in LOSS.findall(done.stdout)}
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1], done.stdout


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.route
def test_a_key_of_megatron_dualpipe_s_own_loop_is_refused_before_any_rank() -> None:
    assert _refused("output_dir=runs") == (
        f"megatron-dualpipe: error: {TINY} with --set train_iters=3 --set eval_interval=3 "
        "--set eval_iters=1 --set hidden_dropout=0 --set attention_dropout=0 --set "
        "distributed_timeout_minutes=1 --set output_dir=runs: output_dir is not an argument "
        "of Megatron-LM's pretrain: write a Megatron-LM flag in snake case, or remove it"
    )


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.route
def test_an_asynchronous_save_on_cpu_ranks_is_refused_before_any_rank(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal is of CPU ranks")
    said = _refused(
        f"save={tmp_path / 'ckpt'}", "save_interval=2", "async_save=true",
        "use_persistent_ckpt_worker=true", "async_strategy=mcore",
    )  # fmt: skip
    assert said.endswith(
        "async_save with use_persistent_ckpt_worker cannot run on CPU ranks: Megatron-Core's "
        "persistent checkpoint worker selects a CUDA device as it starts, fails without one, "
        "and the ranks would wait on it for ever: set async_save: false here (saves are then "
        "synchronous)"
    ), said
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.megatron
def test_another_megatron_core_is_refused_in_one_sentence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from megatron_dualpipe.cli.command import main
    from megatron_dualpipe.megatron.compat.version import installed_megatron_core, megatron_lm_tag

    if _megatron_core_0_19():
        pytest.skip("megatron-core 0.19 is installed: its loop runs")
    assert main(["train", "--config", str(TINY)]) == 2
    tag = megatron_lm_tag()
    assert capsys.readouterr().err == (
        "megatron-dualpipe: error: train runs Megatron-LM's pretrain() from the "
        "megatron/training of megatron-core 0.19's wheel, but megatron-core "
        f"{installed_megatron_core()} is installed: on Python 3.12, pip install "
        f"'megatron-core==0.19.2'; with this release, apply patches/megatron-lm-{tag}.patch to "
        f"a Megatron-LM checkout at {tag} and run its pretrain_gpt.py with --pipeline-schedule\n"
    )


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.route
def test_under_srun_each_process_is_a_rank_and_trains_as_forked(tmp_path: Path) -> None:
    """Two processes with srun's variables (as ``srun --ntasks 2`` starts them) train the
    digits that the two ranks the command forks itself train."""
    from megatron_dualpipe.runtime.launch import pick_port

    forked = _trained("dualpipev")
    assert forked.returncode == 0, forked.stderr[-3000:]
    command = _command("pipeline_schedule=dualpipev", TIED)
    port, ranks = str(pick_port()), []
    try:
        for rank in range(2):
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
            env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
            with (
                (tmp_path / f"{rank}.out").open("w") as out,
                (tmp_path / f"{rank}.err").open("w") as err,
            ):  # the child keeps its own copies of the two files
                ranks.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err))
        codes = [rank.wait(timeout=600) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    errors = [(tmp_path / f"{r}.err").read_text()[-2000:] for r in range(2)]
    assert codes == [0, 0], errors
    printed = "".join((tmp_path / f"{r}.out").read_text() for r in range(2))
    assert LOSS.findall(printed) == LOSS.findall(forked.stdout) != []
    assert VALIDATION.findall(printed) == VALIDATION.findall(forked.stdout) != []


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.route
def test_a_crafted_checkpoint_to_load_is_refused_before_any_rank(tmp_path: Path) -> None:
    """Megatron-LM's reader would unpickle the index with plain ``pickle``: the command reads
    it the safe way first, and the marker the pickle would make is never made."""
    import pickle

    from tests.test_checkpoint_trust import OPEN, _checkpoint, _Creates

    root, marker = tmp_path / "ck", tmp_path / "ran"
    directory = _checkpoint(root / "iter_0000002")
    (root / "latest_checkpointed_iteration.txt").write_text("2\n")
    (directory / ".metadata").write_bytes(pickle.dumps(_Creates(marker)))
    assert _refused(f"load={root}") == (
        f"megatron-dualpipe: error: --load {root}: iter_0000002 cannot be loaded, .metadata "
        f"refers to {OPEN}, which is not one of torch.distributed.checkpoint's metadata "
        "classes (nothing of it was run): there is no complete checkpoint in it: drop --load "
        "to train from scratch"
    )
    assert not marker.exists()


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.route
def test_a_save_folder_another_run_holds_is_refused_before_any_rank(tmp_path: Path) -> None:
    """Two runs saving into one folder would overwrite each other's iterations: while this
    test holds the folder, the command refuses it in one sentence, and no rank trains."""
    import socket

    from megatron_dualpipe.megatron.checkpoint.lock import LOCK_NAME, save_lock

    save = tmp_path / "ck"
    with save_lock(save):
        started = (save / LOCK_NAME).read_text().split(maxsplit=2)[2].strip()
        said = _refused(f"save={save}", "save_interval=3")
    assert said == (
        f"megatron-dualpipe: error: save: {save} is in use by another run (pid {os.getpid()} "
        f"on {socket.gethostname()}, started {started}): wait for it to finish, or set save to "
        "another directory"
    )


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.route
def test_a_saved_order_trains_with_the_generated_order_s_losses(tmp_path: Path) -> None:
    """``simulate --optimize --save`` writes a reordering of dualpipev's work (49 units at
    F=B=W where the generated order takes 50), and ``pipeline_schedule_file`` runs it: the
    digits of the generated order, at every step and validation."""
    order = tmp_path / "order.txt"
    simulate = [sys.executable, "-m", "megatron_dualpipe", "simulate", "--schedule",
                "dualpipev", "--pp", "2", "--microbatches", "8", "--optimize", "--save",
                str(order)]  # fmt: skip
    saved = subprocess.run(simulate, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert saved.returncode == 0, saved.stderr[-2000:]
    generated = _trained("dualpipev")
    reordered = _train("pipeline_schedule=dualpipev", TIED, f"pipeline_schedule_file={order}")
    for done in (generated, reordered):
        assert done.returncode == 0, done.stderr[-3000:]
    said = f"pipeline schedule: dualpipev (megatron-dualpipe's, in the order saved in {order})"
    assert said in reordered.stdout + reordered.stderr
    assert LOSS.findall(reordered.stdout) == LOSS.findall(generated.stdout) != []
    assert VALIDATION.findall(reordered.stdout) == VALIDATION.findall(generated.stdout) != []


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["dualpipev", "1f1b"])
@pytest.mark.route
def test_the_timeline_of_a_run_is_drawn_and_summarised_and_changes_no_digit(
    tmp_path: Path, schedule: str
) -> None:
    """``pipeline_timeline``: iteration 2 measured on both pipeline ranks (ours by its
    executor, Megatron's 1F1B through its timers), drawn into the PNG above the simulator's
    prediction, each rank's measured and simulated bubble printed; the losses are the
    run's without it."""
    png = tmp_path / "out" / "timeline.png"
    plain = _trained(schedule)
    drawn = _train(f"pipeline_schedule={schedule}", TIED, f"pipeline_timeline={png}")
    for done in (plain, drawn):
        assert done.returncode == 0, done.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = drawn.stdout.splitlines()
    first = lines.index(next(line for line in lines if line.startswith(" measured step:")))
    assert re.fullmatch(
        rf" measured step: iteration 2, {schedule}, PP=2, 8 micro-batches, makespan [\d.]+ ms "
        r"\(data-parallel rank 0\)",
        lines[first],
    ), lines[first]
    for rank in range(2):
        assert re.fullmatch(
            rf"   pipeline rank {rank}: busy [\d.]+ ms, bubble [\d.]+% \(simulated [\d.]+%\)",
            lines[first + 1 + rank],
        ), lines[first + 1 + rank]
    bound = re.fullmatch(
        r" compute bound [\d.]+ ms \(the measured F, B and W compute shared evenly over the "
        r"ranks\): the measured step is ([\d.]+)x it, the simulated ([\d.]+)x",
        lines[-2],
    )
    # The bound comes from the measured mean times: on a loaded machine the measured step
    # came under it (0.628x, CI of 2026-12-07), so only its figures are checked here.
    assert bound is not None and float(bound[1]) > 0 and float(bound[2]) > 0, lines[-2]
    assert lines[-1] == f" timeline (measured above, simulated below): {png}"
    assert LOSS.findall(drawn.stdout) == LOSS.findall(plain.stdout) != []


def _indexed_dataset(prefix: Path, documents: int) -> str:
    """``prefix``'s ``.bin`` and ``.idx`` with ``documents`` documents of three tokens, as
    Megatron-Core's ``IndexedDatasetBuilder`` writes them."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin")
    for document in range(documents):
        builder.add_document(torch.tensor([1, 2, document + 3]), [3])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


#: Data files that cannot train, each with the ``--set`` items that give them to the tiny
#: config (the dataset prefix is ``{prefix}``, a blend's config file ``{blend}``).
DATA_CASES = {
    "no .idx": [],
    "a split without tokens": [],
    "split 0,0,0": ["split=0,0,0"],
    "a token beyond the vocabulary": ["split=1,0,0"],
    "a cache beside the data that cannot be written": ["split=1,0,0"],
}


def _data_case(root: Path, case: str) -> tuple[str, list[str], str]:
    """The config, its ``--set`` items and the dataset prefix of one of :data:`DATA_CASES`,
    its files written under ``root``."""
    prefix = _indexed_dataset(root / "data" / "c3_text_document", 3)
    if case == "no .idx":
        Path(f"{prefix}.idx").unlink()
    if case == "a cache beside the data that cannot be written":
        Path(prefix).mkdir()  # where Megatron-Core's GPTDataset puts its cache folder...
        (Path(prefix) / "cache").write_text("")  # ...a file is in the way
    # Megatron-Core's NullTokenizer(4): ids 0 to 3 (3 its end of document); the data holds 5.
    vocab = 4 if case == "a token beyond the vocabulary" else 64
    sets = [f"data_path={prefix}", "tokenizer_type=NullTokenizer", f"vocab_size={vocab}"]
    return str(TINY), [*SETS, *sets, *DATA_CASES[case]], prefix


def _blend_case(root: Path, weighted: bool) -> tuple[str, list[str], str]:
    """Two datasets of 3 documents (9 tokens each) as one blend, weighted or not; the
    first's prefix."""
    a = _indexed_dataset(root / "data" / "a_text_document", 3)
    b = _indexed_dataset(root / "data" / "b_text_document", 3)
    config = root / "blend.yaml"
    blend = [0.5, a, 0.5, b] if weighted else [a, b]
    config.write_text(TINY.read_text() + f"data_path: {json.dumps(blend)}\nvocab_size: 64\n")
    return str(config), list(SETS), a


def _refusals(rank: int, world_size: int, cases: dict) -> dict[str, str | None]:
    """One forked process (one import of Megatron-LM's training for every case): each
    case's config through the checks ``train`` runs before any rank, in the patched
    ``megatron.training`` it runs them in; the sentence it is refused with, or None."""
    from megatron_dualpipe.megatron.lm_launch import (
        checked_run_argv,
        patched_training,
        read_config,
    )

    said: dict[str, str | None] = {}
    with patched_training():
        for name, (config, sets, _) in cases.items():
            try:
                checked_run_argv(*read_config(Path(config), sets), on_cpu=True)
                said[name] = None
            except MegatronLMConfigError as err:
                said[name] = str(err)
    return said


@pytest.fixture(scope="module")
def data_refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Every data case's (refusal, dataset prefix): :data:`DATA_CASES` and the two blends."""
    cases = {c: _data_case(tmp_path_factory.mktemp("data"), c) for c in DATA_CASES}
    for weighted, name in ((False, "blend unweighted"), (True, "blend weighted")):
        cases[name] = _blend_case(tmp_path_factory.mktemp("blend"), weighted)
    (said,) = run_workers(_refusals, 1, args=(cases,), timeout_s=300.0)
    return {name: (said[name], cases[name][2]) for name in cases}


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("case", list(DATA_CASES))
@pytest.mark.route
def test_data_files_that_cannot_train_are_refused_before_any_rank(
    data_refusals: dict, case: str
) -> None:
    """Megatron-LM's GPTDataset loops for ever on a split without tokens (its legacy split,
    969,30,1, gives the valid split of 3 documents none), and fails in every rank on a
    missing file or a split it cannot read: one sentence first (the checks ``train`` runs
    before any rank; that ``train`` runs them: the test after this one)."""
    said, prefix = data_refusals[case]
    vocab = 4 if case == "a token beyond the vocabulary" else 64
    assert said is not None and said.startswith(f"{TINY} with --set train_iters=3 "), said
    assert said.split(f" --set vocab_size={vocab}", 1)[1] == {
        "no .idx": f": data_path: {prefix}.idx does not exist: name each dataset by the prefix "
        "its .bin and .idx share (megatron-dualpipe preprocess --output-prefix P writes "
        "P_text_document.bin and .idx)",
        "a split without tokens": f": split: 969, 30, 1 gives the valid split 0 of the 3 "
        f"documents of {prefix} (3.00% of them, rounded by Megatron-Core to documents 3 to 3; 0 "
        "tokens), and Megatron-Core's GPTDataset loops for ever on a split without tokens: set "
        "its weight to 0 (split: 969,0,1) and set eval_iters: 0, or a corpus of at least 1,001 "
        "documents",
        "split 0,0,0": " --set split=0,0,0: split: '0,0,0' is not a split Megatron-Core reads: "
        "give up to three weights for train, valid and test, at least one above 0, such as "
        "969,30,1",
        "a token beyond the vocabulary": f" --set split=1,0,0: data_path: {prefix}.bin holds "
        "token id 5, beyond the 4 ids of the tokenizer (NullTokenizer): train with the "
        "tokenizer that wrote it, or preprocess the corpus again with this one",
        "a cache beside the data that cannot be written": " --set split=1,0,0: "
        "data_cache_path is not set, so Megatron-Core writes the dataset index caches of "
        f"{prefix} into {prefix}/cache/GPTDataset_indices, which cannot be written (Not a "
        "directory): set data_cache_path to a folder this user can write to",
    }[case]


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.route
def test_train_refuses_data_files_before_any_rank(tmp_path: Path) -> None:
    """``train`` itself, on a split without tokens: exit 2, the sentence, nothing trained."""
    _, sets, prefix = _data_case(tmp_path, "a split without tokens")
    said = _refused(*sets[len(SETS) :])
    assert said.startswith(f"megatron-dualpipe: error: {TINY} with --set train_iters=3 ")
    assert said.endswith(
        f"split: 969, 30, 1 gives the valid split 0 of the 3 documents of {prefix} (3.00% of "
        "them, rounded by Megatron-Core to documents 3 to 3; 0 tokens), and Megatron-Core's "
        "GPTDataset loops for ever on a split without tokens: set its weight to 0 (split: "
        "969,0,1) and set eval_iters: 0, or a corpus of at least 1,001 documents"
    ), said


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.route
def test_a_blend_whose_split_gets_no_token_says_what_megatron_core_does(
    data_refusals: dict, weighted: bool
) -> None:
    """Two datasets of 3 documents (9 tokens) under the legacy split: the valid split gets
    none. An unweighted blend weighs each dataset by its samples (of seq_length + 1 = 17
    tokens), and Megatron-Core's BlendedDataset asserts every weight above 0 (rank 0
    stops): the train split already has none; a weighted one loops for ever on the valid
    split."""
    said, a = data_refusals["blend weighted" if weighted else "blend unweighted"]
    assert said is not None
    if weighted:  # the valid split: no token
        assert f"split: 969, 30, 1 gives the valid split 0 of the 3 documents of {a} " in said
        assert "and Megatron-Core's GPTDataset loops for ever on a split without tokens: " in said
        return
    # Unweighted, the train split's 9 tokens already make no sample of 16 + 1.
    assert said.endswith(
        f"split: 969, 30, 1 gives the train split 3 of the 3 documents of {a} (96.90% of them, "
        "rounded by Megatron-Core to documents 0 to 3; 9 tokens), not one sample of "
        "seq_length + 1 tokens, and Megatron-Core's BlendedDataset stops rank 0 on it with a "
        "bare AssertionError while the other ranks wait for it (an unweighted blend weighs "
        "each dataset by its samples): give the blend weights, or this split at least 17 tokens"
    ), said


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.route
def test_the_readme_data_config_trains_through_megatron_lm_s_loop(tmp_path: Path) -> None:
    """The README's own data (a jsonl corpus, a Hugging Face tokenizer made offline,
    ``preprocess``) trained by Megatron-LM's loop from configs/tiny_gpt_data.yaml: Megatron-
    Core's GPTDataset and HuggingFaceTokenizer, TensorBoard events, the loss falling; the
    same data under a smaller tokenizer refused before any rank (its token ids checked
    against that tokenizer's vocabulary)."""
    from tests.corpus import train_tokenizer, write_corpus

    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    train_tokenizer(corpus, tmp_path / "tokenizer")
    train_tokenizer(corpus, tmp_path / "small", vocab_size=280)
    command = [sys.executable, "-m", "megatron_dualpipe"]
    prepared = subprocess.run(
        [*command, "preprocess", "--input", "corpus.jsonl", "--tokenizer", "tokenizer"]
        + ["--output-prefix", "data/corpus"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    train = [*command, "train", "--config", "configs/tiny_gpt_data.yaml"]
    # Megatron-Core builds the dataset's index on rank 0 while the other ranks wait for it at
    # a barrier of distributed_timeout_minutes: a loaded machine gets three.
    sets = ["distributed_timeout_minutes=3", "train_iters=6", "eval_interval=6", "eval_iters=1"]
    train += [arg for item in sets for arg in ("--set", item)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = {int(i): float(loss) for i, loss in LOSS.findall(done.stdout)}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1], done.stdout[-3000:]
    assert VALIDATION.findall(done.stdout) != []
    assert list((tmp_path / "runs" / "tiny_gpt_data-tensorboard").glob("events.out.tfevents.*"))
    small = subprocess.run(
        [*train, "--set", "tokenizer_model=small"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert small.returncode == 2, small.stderr[-2000:]
    said = small.stderr.splitlines()[-1]
    assert re.search(
        r"data_path: data/corpus_text_document\.bin holds token id \d+, beyond the 28\d ids of "
        r"the tokenizer \(HuggingFaceTokenizer\): train with the tokenizer that wrote it",
        said,
    ), said

def _walkthrough() -> list[list[str]]:
    """The README's "Save, stop, resume, change the schedule" commands, each as argv after
    ``megatron-dualpipe``."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("### Save, stop, resume, change the schedule", 1)[1]
    block = block.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()[:1] != "#"]
    assert all(argv[0] == "megatron-dualpipe" for argv in commands), commands
    return [argv[1:] for argv in commands]



@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.route
def test_the_readme_resume_walkthrough_runs_through_megatron_lm_s_loop(tmp_path: Path) -> None:
    """The README's four save / stop / resume commands as written, where they run
    Megatron-LM's ``pretrain()`` (megatron-core 0.19): stopped at 5, resumed under 1f1b to 10,
    the reached checkpoint trains nothing, then on to 15."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    outputs = []
    for argv in _walkthrough():
        done = subprocess.run(
            [sys.executable, "-m", "megatron_dualpipe", *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert PRETRAIN_BUILT.search(done.stdout), argv  # Megatron-LM's get_model
        outputs.append(done.stdout + done.stderr)
    stop, resume, again, further = outputs
    loaded = "successfully loaded checkpoint from ckpt [ t 1/1, gtp_remat 1/1, p 1/2 ] at "
    assert [int(i) for i, _ in LOSS.findall(stop)] == [1, 2, 3, 4, 5]
    assert "[exiting program at iteration 5]" in stop
    assert f"{loaded}iteration 5" in resume
    assert "pipeline schedule: Megatron's own" in resume
    assert [int(i) for i, _ in LOSS.findall(resume)] == [6, 7, 8, 9, 10]
    assert f"{loaded}iteration 10" in again and LOSS.findall(again) == []
    assert [int(i) for i, _ in LOSS.findall(further)] == [11, 12, 13, 14, 15]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "15"


def _readme_demos() -> list[list[str]]:
    """The README's ``megatron-dualpipe train`` block: each demo's argv after
    ``megatron-dualpipe`` (the tiny configs', not the dry run's, not tiny_gpt_cpu's that
    other tests run)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("## `megatron-dualpipe train`", 1)[1].split("```bash\n", 1)[1]
    block = block.split("```", 1)[0].replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [
        argv[1:]
        for argv in commands
        if argv and "--dry-run" not in argv and "configs/tiny_gpt_cpu.yaml" not in argv
    ]


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("argv", _readme_demos(), ids=lambda argv: " ".join(argv[2:]))
@pytest.mark.route
def test_the_readme_s_demos_train_through_megatron_lm_s_loop(argv: list[str]) -> None:
    """Where megatron-core 0.19 is installed the README's demos run Megatron-LM's
    ``pretrain()``: MoE, DeepSeek-V3's shape, the F&B overlap in bf16 (three steps each)."""
    sets = ("train_iters=3", "eval_interval=3", "eval_iters=1")
    command = [sys.executable, "-m", "megatron_dualpipe", *argv]
    command += [arg for item in sets for arg in ("--set", item)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert PRETRAIN_BUILT.search(done.stdout)
    assert [int(step) for step, _ in LOSS.findall(done.stdout)] == [1, 2, 3]
