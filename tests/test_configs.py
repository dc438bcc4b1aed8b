"""The shipped configs: each one read as ``simulate`` and the memory model read it (its
values over Megatron-LM's defaults: the model's shape and its split into the schedule's
stages), the realistic ones the models they name, and a mistake in one refused by
``train`` in one sentence naming the file, the key and the fix, before any rank starts.
Megatron-LM's own build of them: the dry runs of tests/test_megatron_lm_dry_run.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe.planner.advisor import stages_for
from megatron_dualpipe.planner.config_advice import ConfigModel
from megatron_dualpipe.schedules.registry import spec

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(ROOT.glob("configs/*.yaml"))
TINY = ROOT / "configs" / "tiny_gpt_cpu.yaml"


def _config(name: str) -> ConfigModel:
    return ConfigModel.read(ROOT / "configs" / name, [])


def _stage_layers(model: ConfigModel) -> list[int]:
    """Decoder layers per model stage, in pipeline order."""
    setup = model.setup
    stages = spec(setup.pipeline_schedule).model_stages(
        setup.pipeline_model_parallel_size, setup.virtual_pipeline_model_parallel_size
    )
    return [text.count("t") for text in stages_for(model.shape, model.setup, stages)]


def test_the_six_configs_are_there() -> None:
    assert {p.name for p in CONFIGS} == {
        "tiny_gpt_cpu.yaml",
        "tiny_gpt_data.yaml",
        "tiny_moe_cpu.yaml",
        "tiny_deepseek_cpu.yaml",
        "deepseek_v3_pp16.yaml",
        "dense_70b_dualpipe.yaml",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_splits_under_its_schedule(path: Path) -> None:
    model = ConfigModel.read(path, ["vocab_size=128"])  # tiny_gpt_data's is the tokenizer's
    setup = model.setup
    assert setup.num_microbatches * setup.micro_batch_size * setup.data_parallel_size == (
        setup.global_batch_size
    )
    assert sum(_stage_layers(model)) == model.shape.num_layers


def test_the_realistic_configs_are_what_they_say() -> None:
    deepseek = _config("deepseek_v3_pp16.yaml")
    shape, setup = deepseek.shape, deepseek.setup
    assert (setup.pipeline_schedule, setup.pipeline_model_parallel_size) == ("dualpipe", 16)
    assert setup.expert_model_parallel_size > 1
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size) == (61, 7168, 129280)
    assert [shape.is_moe(i) for i in range(61)] == [False] * 3 + [True] * 58
    assert (shape.num_experts, shape.moe_router_topk) == (256, 8)
    assert shape.moe_shared_expert_intermediate_size == shape.moe_ffn_hidden_size
    values = deepseek.values
    assert values["moe_router_score_function"] == "sigmoid"
    assert values["moe_router_enable_expert_bias"] is True
    assert shape.multi_latent_attention and shape.mtp_num_layers == 1
    assert (shape.q_lora_rank, shape.kv_lora_rank) == (1536, 512)
    assert (shape.qk_head_dim, shape.qk_pos_emb_head_dim, shape.v_head_dim) == (128, 64, 128)
    assert shape.seq_length == 4096
    stages = _stage_layers(deepseek)
    assert len(stages) == 16 and sum(stages) == 61
    tiny = _config("tiny_deepseek_cpu.yaml")
    assert (tiny.setup.pipeline_schedule, tiny.setup.expert_model_parallel_size) == (
        "dualpipev",
        2,
    )
    assert tiny.shape.multi_latent_attention and tiny.shape.mtp_num_layers == 1
    assert not tiny.shape.is_moe(0) and len(set(_stage_layers(tiny))) > 1  # dense, uneven
    dense = _config("dense_70b_dualpipe.yaml")
    assert (dense.setup.pipeline_schedule, dense.setup.pipeline_model_parallel_size) == (
        "dualpipe",
        8,
    )
    params = 12 * dense.shape.num_layers * dense.shape.hidden_size**2  # order of magnitude
    assert 50e9 < params < 100e9


def test_a_layout_in_a_config_splits_as_it_spells(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(
        TINY.read_text(encoding="utf-8") + '\npipeline_model_parallel_layout: "Ettt|t|tt|ttL"\n',
        encoding="utf-8",
    )
    assert _stage_layers(ConfigModel.read(path, [])) == [3, 1, 2, 2]


@pytest.mark.megatron
@pytest.mark.route
def test_train_prints_the_sentence_and_fails(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(TINY.read_text(encoding="utf-8") + "\nnum_layer: 8\n", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "megatron_dualpipe", "train", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"megatron-dualpipe: error: {path}: num_layer is not an argument of Megatron-LM's "
        "pretrain (did you mean 'num_layers'?): write a Megatron-LM flag in snake case, or "
        "remove it"
    )
