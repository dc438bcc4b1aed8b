"""The per-rank memory model (``planner/memory.py``): its saved activations are the cost
model's, its activation peaks count as the simulator counts, its bytes per parameter are
Megatron's distributed-optimizer accounting, recomputation and FP8 change what they
should, the parameters per rank are those Megatron-Core builds under our placements
(every copy of an embedding table counted), ``simulate --config`` prints it, and
``configs/deepseek_v3_pp16.yaml``'s settings fit an 80 GB GPU under dualpipe and dualpipev.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_dualpipe.planner.advisor import ParallelSetup, stages_for
from megatron_dualpipe.planner.config_advice import MEGATRON_LM_UNSET
from megatron_dualpipe.planner.memory import (
    GIB,
    MemoryModel,
    MemorySettings,
    PhasePeaks,
)
from megatron_dualpipe.planner.model_cost import ModelShape, stage_costs
from megatron_dualpipe.schedules.config_values import ConfigValueError, read_values
from megatron_dualpipe.schedules.registry import generate, spec
from megatron_dualpipe.schedules.simulate import simulate
from tests.multiproc import one_fast

ROOT = Path(__file__).resolve().parents[1]
DEEPSEEK = ROOT / "configs" / "deepseek_v3_pp16.yaml"
#: DeepSeek-V3 under dualpipev: the balance advisor's layout of 61 layers over 32 stages.
DUALPIPEV = [
    "pipeline_schedule=dualpipev",
    "decoder_first_pipeline_num_layers=null",
    "decoder_last_pipeline_num_layers=null",
    "pipeline_model_parallel_layout=Et|(tt|)*30,mL",
]
#: What an 80 GB GPU leaves for the model (GiB): the rest for the CUDA context, NCCL and
#: all-to-all buffers and fragmentation, which the model does not count.
FITS_80GB = 72.0

SHAPES = [
    ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=96),
    ModelShape(
        num_layers=6,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=2,
        seq_length=16,
        vocab_size=128,
        swiglu=True,
        normalization="RMSNorm",
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=32,
        moe_layer_freq="[0]*2+[1]*4",
        mtp_num_layers=1,
        add_bias_linear=False,
    ),
    ModelShape(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=64,
        multi_latent_attention=True,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=8,
        num_experts=4,
        moe_layer_freq=[0, 1, 1, 1],
    ),
]


def _layers(shape: ModelShape, counts: list[int]) -> list[str]:
    stages = ["E" + "t" * counts[0]] + ["t" * c for c in counts[1:]]
    stages[-1] += "m" * shape.mtp_layers + "L"
    return stages


@pytest.mark.parametrize("shape", SHAPES, ids=["dense", "gqa-moe-mtp", "mla-moe"])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_saved_activations_are_the_cost_models(shape: ModelShape, tp: int, sp: bool) -> None:
    """One account of saved tensors: the memory model's, per stage and micro-batch, sum to
    model_cost's ``activations`` (which the advisor's FLOP side and docs/advisor.md use)."""
    counts = [1] * shape.num_layers
    stages = _layers(shape, counts)
    schedule = generate("1f1b", len(stages), 2 * len(stages))
    model = MemoryModel(shape, schedule, tokens=32, tensor_parallel=tp, sequence_parallel=sp)
    expected = stage_costs(shape, stages, tokens=32, tensor_parallel=tp, sequence_parallel=sp)
    for ours, theirs in zip(model.stages(stages), expected, strict=True):
        assert ours.saved == pytest.approx(theirs.activations, rel=1e-12)


@pytest.mark.parametrize("name", ["1f1b", "zb1p", "dualpipe", "dualpipev"])
def test_phase_peaks_count_as_the_simulator_counts(name: str) -> None:
    """A micro-batch counted from F until its W (or BW) as one unit is the simulator's
    peak of live activations; held for W costs nothing under schedules without W."""
    schedule = generate(name, 4, 10)
    peaks = PhasePeaks(schedule)
    stages = schedule.placement.num_model_stages
    counted = [r.peak_activations for r in simulate(schedule).ranks]
    assert peaks([1.0] * stages, [1.0] * stages) == counted
    only_saved = peaks([1.0] * stages, [0.0] * stages)
    assert all(s <= c for s, c in zip(only_saved, counted, strict=True))
    if name == "1f1b":  # no W: the same
        assert only_saved == counted


def test_bytes_per_parameter_follow_megatrons_distributed_optimizer_accounting() -> None:
    schedule = generate("1f1b", 2, 4)
    shape = SHAPES[0]

    def per_param(bf16: bool, optimizer: str, d: int) -> tuple[float, float]:
        m = MemoryModel(shape, schedule, tokens=8, bf16=bf16, optimizer=optimizer)
        weight, grad, distributed, plain = m.bytes_per_parameter(d)
        return weight + grad + distributed, weight + grad + plain

    assert per_param(True, "adam", 8) == (6 + 12 / 8, 18)  # docs/.../dist_optimizer.md
    assert per_param(False, "adam", 4) == (8 + 8 / 4, 16)
    assert per_param(True, "sgd", 2) == (6 + 8 / 2, 14)


def test_recomputation_keeps_what_megatron_keeps() -> None:
    shape = SHAPES[1]
    schedule = generate("1f1b", 2, 4)
    stage = "tttt"

    def saved(**settings: Any) -> float:
        model = MemoryModel(shape, schedule, tokens=16, settings=MemorySettings(**settings))
        return model.stage(stage, 2).saved

    none = saved()
    inputs = shape.hidden_size * 2 * 16  # one layer's input, bf16, per micro-batch
    assert (
        saved(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        == 4 * inputs
    )
    assert (
        saved(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)
        == 2 * inputs
    )
    block = saved(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    assert inputs < block < none
    selective = {
        m: saved(recompute_granularity="selective", recompute_modules=m)
        for m in ("core_attn", "layernorm", "moe_act", "moe", "shared_experts")
    }
    assert selective["core_attn"] == none  # flash attention saves no scores
    assert selective["moe"] < selective["moe_act"] < none
    assert selective["moe"] < selective["shared_experts"] < none
    assert selective["layernorm"] < none


def test_fp8_halves_linear_inputs_and_caches_fp8_weights() -> None:
    shape = SHAPES[0]
    schedule = generate("zb1p", 2, 4)
    stages = _layers(shape, [2, 2])
    bf16 = MemoryModel(shape, schedule, tokens=16).ranks(stages)
    fp8 = MemoryModel(shape, schedule, tokens=16, settings=MemorySettings(fp8="e4m3")).ranks(stages)
    for a, b in zip(bf16, fp8, strict=True):
        assert b.activations < a.activations
        assert b.weights > a.weights and b.gradients == a.gradients


def test_every_copy_of_a_vocabulary_table_is_counted() -> None:
    """Under dualpipev rank 0 holds the embedding (stage 0), and in stage 2P-1 the output
    layer and the MTP block's own copy of the embedding (untied): three tables; tied, the
    loss stage's output layer shares its chunk's embedding copy: two."""
    shape = SHAPES[1]
    schedule = generate("dualpipev", 2, 4)
    stages = _layers(shape, [2, 1, 1, 2])
    table = shape.vocab_size * shape.hidden_size
    untied_shape = dataclasses.replace(shape, untie_embeddings_and_output_weights=True)
    untied = MemoryModel(untied_shape, schedule, tokens=16).ranks(stages)[0]
    tied_shape = dataclasses.replace(shape, untie_embeddings_and_output_weights=False)
    tied = MemoryModel(tied_shape, schedule, tokens=16).ranks(stages)[0]
    assert untied.params - tied.params == table


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"fp8": "e5m2"}, "fp8: 'e5m2' is not one of e4m3, hybrid"),
        ({"recompute_granularity": "full"}, "full needs recompute_method"),
        ({"recompute_granularity": "selective", "recompute_modules": "mlp attn"}, "'attn'"),
        ({"recompute_granularity": "selective", "recompute_modules": ["mlp", "attn"]}, "'attn'"),
        ({"recompute_granularity": "selective", "recompute_modules": 3}, "module names"),
    ],
)
def test_bad_settings_are_one_sentence(settings: dict, message: str) -> None:
    with pytest.raises(ConfigValueError, match=message) as err:
        MemorySettings.from_values(settings, "cfg.yaml")
    assert "\n" not in str(err.value)


def test_recompute_modules_read_as_megatron_lms_list_or_as_words() -> None:
    """A list is what Megatron-LM's ``--recompute-modules`` takes (``train`` passes it so);
    the memory model read words only, and a list was a type error."""
    listed = {"recompute_granularity": "selective", "recompute_modules": ["moe_act", "mlp"]}
    words = {**listed, "recompute_modules": "moe_act mlp"}
    assert MemorySettings.from_values(listed, "cfg.yaml") == MemorySettings.from_values(
        words, "cfg.yaml"
    )


def _deepseek_ranks(overrides: list[str]) -> list[Any]:
    values = {**MEGATRON_LM_UNSET, **read_values(DEEPSEEK, overrides)}
    shape = ModelShape.from_values(values, "deepseek")
    setup = ParallelSetup.from_values(values, "deepseek")
    settings = MemorySettings.from_values(values, "deepseek")
    found = spec(setup.pipeline_schedule)
    schedule = found.generate(setup.pipeline_model_parallel_size, setup.num_microbatches)
    stages = stages_for(shape, setup, schedule.placement.num_model_stages)
    return MemoryModel.for_setup(shape, setup, schedule, settings).ranks(stages)


@pytest.mark.parametrize("schedule", [[], DUALPIPEV], ids=["dualpipe", "dualpipev"])
def test_deepseek_v3_config_fits_an_80gb_gpu(schedule: list[str]) -> None:
    """The config's FP8 and recomputation settings leave every rank within 72 GiB, and
    without them no rank would fit (so the settings are what makes it fit)."""
    fitted = _deepseek_ranks(schedule)
    assert max(r.total for r in fitted) / GIB <= FITS_80GB
    recompute_off = ["recompute_granularity=null", "recompute_method=null"]
    recompute_off.append("recompute_num_layers=null")
    for dropped in (["fp8=null"], recompute_off, ["fp8=null", *recompute_off]):
        assert max(r.total for r in _deepseek_ranks([*schedule, *dropped])) / GIB > 80


def test_simulate_config_prints_every_ranks_memory() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dualpipe", "simulate", "--config", str(DEEPSEEK)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "memory per rank under dualpipe, the config's split, in GiB" in out
    ranks = _deepseek_ranks([])
    rows = re.findall(r"^\s+(\d+)\s+(\d+) (\d+)\s.*\s(\d+\.\d)\s+(\d+\.\d)$", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(16))
    assert [float(r[3]) for r in rows] == [round(r.total / GIB, 1) for r in ranks]
    worst = max(ranks, key=lambda r: r.total)
    assert f"most: {worst.total / GIB:.1f} GiB on rank {worst.rank}" in out


def _built_parameters(rank: int, world_size: int, tied: bool) -> int:
    """Parameters of this rank's dualpipev chunks of SHAPES[1] as Megatron-Core builds
    them (local spec), copies of the embedding included."""
    import torch.nn.functional as F
    from megatron.core import parallel_state

    from megatron_dualpipe.megatron.compat.cpu_compat import apply_cpu_compat
    from megatron_dualpipe.megatron.model.placement import StagePlacementLayout
    from megatron_dualpipe.megatron.model.tied import mark_tied_copies
    from megatron_dualpipe.megatron.schedule.checks import pipeline_setup
    from tests import tiny_models as tm
    from tests.megatron_harness import _init_parallel

    apply_cpu_compat()
    _init_parallel(pp=world_size, schedule="dualpipev")  # our embedding group
    try:
        layout = StagePlacementLayout(pipeline_setup("dualpipev", world_size, (2, 1, 1, 2)), 1)
        config = tm.tiny_gpt_config(
            num_layers=6,
            hidden_size=64,
            num_attention_heads=8,
            num_query_groups=2,
            num_moe_experts=8,
            moe_ffn_hidden_size=48,
            moe_shared_expert_intermediate_size=32,
            moe_layer_freq=[0, 0, 1, 1, 1, 1],
            mtp_num_layers=1,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            pipeline_model_parallel_size=world_size,
            pipeline_model_parallel_layout=layout,
        )
        chunks = [
            tm.build_tiny_gpt(
                config,
                pre_process=r.pre_process,
                post_process=r.post_process,
                vp_stage=r.chunk,
                share_embeddings_and_output_weights=tied,
                vocab_size=128,
                max_sequence_length=16,
            )
            for r in layout.roles(rank)
        ]
        mark_tied_copies(chunks)
        return sum(p.numel() for c in chunks for p in c.parameters())
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.parametrize("tied", one_fast([False, True], False))
def test_parameters_per_rank_are_what_megatron_core_builds(tied: bool) -> None:
    from tests.multiproc import run_workers

    built = run_workers(_built_parameters, 2, args=(tied,), timeout_s=120)
    shape = dataclasses.replace(SHAPES[1], untie_embeddings_and_output_weights=not tied)
    schedule = generate("dualpipev", 2, 4)
    ranks = MemoryModel(shape, schedule, tokens=16).ranks(_layers(shape, [2, 1, 1, 2]))
    assert [int(r.params) for r in ranks] == built
