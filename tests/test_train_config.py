"""``megatron-dualpipe train`` configs: every shipped config validates (and Megatron-Core
accepts its model), and each kind of mistake is refused with one sentence naming the
source, the key and the fix, before anything runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import ConfigError, load_config
from megatron_dualpipe.megatron.training.config import parse_overrides
from tests.processes import OUR_LOOP

CONFIGS = sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml"))
TINY = next(p for p in CONFIGS if p.name == "tiny_gpt_cpu.yaml")


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "x.yaml"
    base = TINY.read_text(encoding="utf-8")
    path.write_text(base + "\n" + text, encoding="utf-8")
    return path


def _error(path: Path, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_five_configs_are_there() -> None:
    assert {p.name for p in CONFIGS} >= {
        "tiny_gpt_cpu.yaml",
        "tiny_moe_cpu.yaml",
        "tiny_deepseek_cpu.yaml",
        "deepseek_v3_pp16.yaml",
        "dense_70b_dualpipe.yaml",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_validates_and_megatron_accepts_its_model(path: Path) -> None:
    from megatron_dualpipe.megatron.training.model import transformer_config

    cfg = load_config(path)
    assert cfg.run_dir == str(Path("runs") / f"{path.stem}-{cfg.pipeline_schedule}")
    # FP8's checks ask Transformer Engine its version: without TE, the rest of the model.
    without_te = ["fp8=null"] if cfg.fp8 is not None else []
    config = transformer_config(load_config(path, without_te), on_gpu=False)
    assert config.num_layers == cfg.num_layers
    assert cfg.num_microbatches * cfg.micro_batch_size * cfg.data_parallel_size == (
        cfg.global_batch_size
    )


def test_realistic_configs_are_what_they_say() -> None:
    deepseek = load_config(next(p for p in CONFIGS if p.name == "deepseek_v3_pp16.yaml"))
    assert deepseek.pipeline_schedule == "dualpipe"
    assert deepseek.pipeline_model_parallel_size == 16
    assert deepseek.is_moe and deepseek.expert_model_parallel_size > 1
    assert (deepseek.num_layers, deepseek.hidden_size, deepseek.vocab_size) == (61, 7168, 129280)
    assert deepseek.moe_layer_pattern == [0] * 3 + [1] * 58
    assert (deepseek.num_experts, deepseek.moe_router_topk) == (256, 8)
    assert deepseek.moe_shared_expert_intermediate_size == deepseek.moe_ffn_hidden_size
    assert deepseek.moe_router_score_function == "sigmoid"
    assert deepseek.moe_router_enable_expert_bias
    assert deepseek.multi_latent_attention and deepseek.mtp_num_layers == 1
    assert (deepseek.q_lora_rank, deepseek.kv_lora_rank) == (1536, 512)
    mla = (deepseek.qk_head_dim, deepseek.qk_pos_emb_head_dim, deepseek.v_head_dim)
    assert mla == (128, 64, 128)
    assert deepseek.seq_length == 4096
    stages = deepseek.stage_layers()
    assert len(stages) == 16 and sum(stages) == 61 and len(set(stages[1:-1])) == 1
    tiny = load_config(next(p for p in CONFIGS if p.name == "tiny_deepseek_cpu.yaml"))
    assert tiny.pipeline_schedule == "dualpipev" and tiny.expert_model_parallel_size == 2
    assert tiny.multi_latent_attention and tiny.mtp_num_layers == 1
    assert 0 in tiny.moe_layer_pattern and len(set(tiny.stage_layers())) > 1  # dense, uneven
    dense = load_config(next(p for p in CONFIGS if p.name.startswith("dense_70b")))
    assert dense.pipeline_schedule == "dualpipe"
    assert dense.pipeline_model_parallel_size == 8
    params = 12 * dense.num_layers * dense.hidden_size**2  # order of magnitude
    assert 50e9 < params < 100e9


def test_unknown_key(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "num_layer: 8"))
    assert message == f"{tmp_path / 'x.yaml'}: num_layer: unknown key (did you mean 'num_layers'?)"


def test_wrong_type(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "hidden_size: wide"))
    assert message == (f"{tmp_path / 'x.yaml'}: hidden_size: expected an integer, got 'wide' (str)")
    assert "micro_batch_size: expected an integer, got 2.5 (float)" in _error(
        _write(tmp_path, "micro_batch_size: 2.5")
    )


def test_dualpipe_with_odd_pp(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "pipeline_schedule: dualpipe\npipeline_model_parallel_size: 3\nworld_size: 3\n"
        "num_layers: 6\nglobal_batch_size: 24",
    )
    assert _error(path) == (
        f"{path}: pipeline_schedule: dualpipe needs an even number of pipeline ranks, got 3: "
        "use an even PP or dualpipev"
    )


def test_too_few_microbatches(tmp_path: Path) -> None:
    path = _write(tmp_path, "global_batch_size: 6")
    assert _error(path) == (
        f"{path}: pipeline_schedule: dualpipev needs the micro-batches to be >= 2 x PP = 4, got "
        "3: raise global_batch_size or lower PP (micro-batches per step = global_batch_size / "
        "(micro_batch_size x data-parallel size) = 6 / (2 x 1))"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("num_layers: 6", "num_layers: dualpipev at PP=2 runs 4 model stages: 6 layers do not"),
        (
            "decoder_first_pipeline_num_layers: 3",
            "decoder_first_pipeline_num_layers: dualpipev at PP=2 runs 4 model stages: after 3",
        ),
        (
            "pipeline_model_parallel_layout: Etttt|ttttL",
            "pipeline_model_parallel_layout: dualpipev at PP=2 runs 4 model stages: the pipeline "
            "layout has 2 stages",
        ),
        (
            "pipeline_model_parallel_layout: Et|ttt|ttt|tL\ndecoder_last_pipeline_num_layers: 1",
            "model stages: a layout string cannot be combined with first/last stage layer counts",
        ),
        ("moe_layer_freq: 2", "moe_layer_freq: needs num_experts"),
        (
            "num_experts: 4\nadd_bias_linear: false\nmoe_layer_freq: '[0]*2+[1]*5'",
            "moe_layer_freq: lists 7 layers but num_layers is 8",
        ),
        (
            "num_experts: 4\nadd_bias_linear: false\nmoe_layer_freq: '[0]*2+1'",
            "moe_layer_freq: '[0]*2+1' is neither an integer nor a sum of 0/1 lists",
        ),
        (
            "num_experts: 4\nadd_bias_linear: false\nmoe_router_enable_expert_bias: true",
            "moe_router_enable_expert_bias: needs moe_router_score_function: sigmoid",
        ),
        ("q_lora_rank: 8", "q_lora_rank: is a multi-latent attention key"),
        ("mtp_num_layers: 0", "mtp_num_layers: must be >= 1, got 0"),
        ("global_batch_size: 15", "global_batch_size: 15 is not divisible by"),
        ("world_size: 3", "world_size: 3 ranks do not split"),
        ("pipeline_schedule: gpipe", "pipeline_schedule: 'gpipe' is not one of 1f1b,"),
        ("num_experts: 4", "add_bias_linear: MoE layers of Megatron-Core's local spec"),
        ("lr: -1.0", "lr: must be a finite number >= 0, got -1.0"),
        ("save_interval: 5", "save_interval: needs save"),
        ("virtual_pipeline_model_parallel_size: 2", "only interleaved-1f1b uses virtual"),
    ],
)
def test_other_mistakes(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in _error(_write(tmp_path, text))


def test_overrides_are_converted_to_the_key_type() -> None:
    assert parse_overrides(
        ["lr=1e-4", "train_iters=7", "bf16=true", "save=ckpt", "eval_interval=null"]
    ) == {"lr": 1e-4, "train_iters": 7, "bf16": True, "save": "ckpt", "eval_interval": None}
    cfg = load_config(TINY, ["pipeline_schedule=1f1b", "lr=5e-4"])
    assert (cfg.pipeline_schedule, cfg.lr) == ("1f1b", 5e-4)


def test_override_mistakes_name_set() -> None:
    assert _error(TINY, ("train_iters=ten",)) == (
        "--set: train_iters: expected an integer, got 'ten'"
    )
    assert _error(TINY, ("schedule=1f1b",)).startswith("--set: schedule: unknown key")
    # A key the file set, made wrong by an override: the file with the override.
    assert _error(TINY, ("pipeline_model_parallel_size=3",)) == (
        f"{TINY} with --set pipeline_model_parallel_size=3: world_size: 2 ranks do not split "
        "into tensor x pipeline groups of 1 x 3: use a multiple of 3"
    )
    # An overridden key's value: the --set alone.
    assert _error(TINY, ("global_batch_size=5",)) == (
        "--set global_batch_size=5: global_batch_size: 5 is not divisible by micro_batch_size "
        "x data-parallel size = 2 x 1"
    )


def test_the_split_keys_read_over_the_schedules_model_stages(tmp_path: Path) -> None:
    uneven = "decoder_first_pipeline_num_layers: 1\ndecoder_last_pipeline_num_layers: 3"
    assert load_config(_write(tmp_path, uneven)).stage_layers() == (1, 2, 2, 3)
    layout = load_config(_write(tmp_path, "pipeline_model_parallel_layout: E|ttt|ttt|ttL"))
    assert layout.stage_layers() == (0, 3, 3, 2)
    # 1f1b: Megatron's own meaning, one stage per pipeline rank.
    one_f_one_b = ["pipeline_schedule=1f1b", "decoder_first_pipeline_num_layers=3"]
    one_f_one_b.append("decoder_last_pipeline_num_layers=5")
    assert load_config(TINY, one_f_one_b).stage_layers() == (3, 5)
    # An integer moe_layer_freq in YAML is Megatron-LM's integer form.
    moe = "num_experts: 4\nadd_bias_linear: false\nmoe_layer_freq: 2"
    assert load_config(_write(tmp_path, moe)).moe_layer_pattern == 2


def test_yaml_float_literals_without_a_dot_are_numbers(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "lr: 1e-3")).lr == 1e-3


def test_cli_prints_the_sentence_and_fails(tmp_path: Path) -> None:
    path = _write(tmp_path, "num_layer: 8")
    done = subprocess.run(
        [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(path), *OUR_LOOP],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"megatron-dualpipe: error: {path}: num_layer: unknown key (did you mean 'num_layers'?)"
    )


def test_the_run_folder_is_named_by_config_schedule_and_the_settings_given(
    tmp_path: Path,
) -> None:
    runs = Path("runs")
    assert load_config(TINY).run_dir == str(runs / "tiny_gpt_cpu-dualpipev")
    one = load_config(TINY, ["pipeline_schedule=1f1b"])
    assert one.run_dir == str(runs / "tiny_gpt_cpu-1f1b")
    moe = Path(TINY).with_name("tiny_moe_cpu.yaml")
    overlap = ["bf16=true", "overlap_moe_expert_parallel_comm=true"]
    assert load_config(moe).run_name == "tiny_moe_cpu-dualpipev"
    assert load_config(moe, overlap).run_name == (
        "tiny_moe_cpu-dualpipev-bf16=true-overlap_moe_expert_parallel_comm=true"
    )
    assert load_config(moe, overlap[::-1]).run_name == load_config(moe, overlap).run_name
    # output_dir is where runs go: each schedule keeps its own folder under it.
    for schedule in ("1f1b", "zb1p"):
        mine = load_config(TINY, [f"pipeline_schedule={schedule}", f"output_dir={tmp_path}"])
        assert mine.run_dir == str(tmp_path / f"tiny_gpt_cpu-{schedule}")
    # Where things go, how often the run logs, saves or stops: the same run, one folder.
    stopped = load_config(TINY, ["train_iters=10", "save=ckpt", "exit_interval=5"])
    resumed = load_config(TINY, ["train_iters=10", "load=ckpt", "save=ckpt", "log_interval=5"])
    assert stopped.run_name == resumed.run_name == "tiny_gpt_cpu-dualpipev-train_iters=10"
    as_the_file = [
        "clip_grad=1.0", "eval_iters=2", "lr=0.003", "lr_warmup_iters=2",
        "micro_batch_size=2", "min_lr=0.0003", "seed=1234", "weight_decay=0.01",
    ]  # fmt: skip
    wordy = load_config(TINY, as_the_file)
    assert re.fullmatch(r"tiny_gpt_cpu-dualpipev-[0-9a-f]{8}", wordy.run_name), wordy.run_name
    assert load_config(TINY, ["run_name=mine"]).run_dir == str(runs / "mine")
    assert load_config(TINY, ["run_name=null"]).run_dir == "runs"
    assert load_config(TINY, ["output_dir=null"]).run_dir is None
    with pytest.raises(ConfigError, match=r"^--set run_name=a/b: run_name: must name one folder"):
        load_config(TINY, ["run_name=a/b"])


def test_moe_defaults_are_megatrons() -> None:
    """Every MoE key defaults to Megatron-Core's TransformerConfig default (the default of
    Megatron-LM's flag); ``moe_layer_freq`` unset means Megatron's 1."""
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    from megatron_dualpipe.megatron.training.config import TrainConfig

    theirs = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    moe = [name for name in ours if name.startswith("moe_") and name != "moe_layer_freq"]
    assert len(moe) >= 10
    assert {n: ours[n] for n in moe} == {n: theirs[n] for n in moe}
    assert ours["moe_layer_freq"] is None and theirs["moe_layer_freq"] == 1
    assert ours["moe_router_load_balancing_type"] == "aux_loss"


DATA = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_data.yaml"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "split=0,0,0",
            "split: '0,0,0' gives every split weight 0: give the training split a weight "
            "above 0 (969,30,1)",
        ),
        (
            "split=-10,110,0",
            "split: '-10,110,0' has a negative weight: give each of train, valid, test a "
            "weight >= 0",
        ),
        (
            "data_path=0.5 A 0.5",
            "data_path: '0.5 A 0.5' has 3 words, among them the number '0.5': a blend "
            "alternates weight and prefix, so give dataset prefixes alone, or pairs of a "
            "weight and a prefix (0.7 data/a_text_document 0.3 data/b_text_document)",
        ),
        (
            "data_path=-0.5 A 1.5 B",
            "data_path: blend weight -0.5 is negative: give each dataset a weight >= 0",
        ),
        (
            "data_path=0 A 0 B",
            "data_path: every blend weight is 0: give at least one dataset a weight above 0",
        ),
    ],
    ids=["all-zero split", "negative split", "odd blend", "negative blend", "zero blend"],
)
def test_split_and_blend_weights_are_one_sentence(override: str, message: str) -> None:
    """Before: 'is not up to three weights', -10 read as 10, '0.5.idx does not exist' (at
    the data files), and Megatron-Core's bare AssertionError for the blend weights."""
    assert _error(DATA, (override,)) == f"--set {override}: {message}"
