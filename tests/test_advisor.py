"""The balance advisor's parts: the layout string read and written as Megatron reads it, the
retimer equal to the simulator, and the search (memory per rank from planner/memory.py,
whose peaks tests/test_memory.py holds to the simulator's):
never worse than the config's split, within the memory cap, and what it proposes loads back."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from megatron_dualpipe.planner.advisor import (
    ParallelSetup,
    StageTiming,
    _Search,
    advise,
    stages_for,
)
from megatron_dualpipe.planner.config_advice import ConfigModel
from megatron_dualpipe.planner.memory import MemoryModel, MemorySettings
from megatron_dualpipe.planner.model_cost import ModelShape
from megatron_dualpipe.planner.retime import Retimer
from megatron_dualpipe.planner.schedule_catalog import SCHEDULES as CATALOG
from megatron_dualpipe.schedules.cost import CostModel
from megatron_dualpipe.schedules.ir import ScheduleError
from megatron_dualpipe.schedules.layer_split import stages_from_counts
from megatron_dualpipe.schedules.layout import check_layout, format_layout, parse_layout
from megatron_dualpipe.schedules.registry import generate
from megatron_dualpipe.schedules.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]

LAYOUTS = [
    ("Et*3|(tt|)*29,m|L", ["Ettt"] + ["tt"] * 29 + ["m", "L"]),
    ("Et|(tt|)*30,mL", ["Et"] + ["tt"] * 30 + ["mL"]),
    ("E|t*4|(|)*2,ttL", ["E", "tttt", "", "", "ttL"]),
    ("Ett|tt|tmL", ["Ett", "tt", "tmL"]),
]


@pytest.mark.parametrize(("text", "stages"), LAYOUTS)
def test_layout_strings_read_and_write_back(text: str, stages: list[str]) -> None:
    assert parse_layout(text) == stages
    assert parse_layout(format_layout(stages)) == stages


@pytest.mark.megatron
@pytest.mark.parametrize(("text", "stages"), LAYOUTS)
def test_layout_strings_read_as_megatron_reads_them(text: str, stages: list[str]) -> None:
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    letters = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    for string in (text, format_layout(stages)):
        theirs = PipelineParallelLayerLayout.parse_str_to_list(string)
        assert ["".join(letters[x.name] for x in stage) for stage in theirs] == stages


@pytest.mark.parametrize(
    ("text", "layers", "mtp", "stages", "message"),
    [
        ("Et|tx|tL", 3, 0, 3, "cannot read the pipeline layout 'Et\\|tx\\|tL' at 'x'"),
        ("Et|tL", 2, 0, 4, "has 2 stages but the schedule cuts the model into 4"),
        ("tE|tL", 2, 0, 2, "must start with E"),
        ("Et|Lt", 2, 0, 2, "must end with L"),
        ("Et|tL", 3, 0, 2, "holds 2 decoder layers \\(t\\) but num_layers is 3"),
        ("Et|tL", 2, 1, 2, "holds 0 MTP layers \\(m\\) but mtp_num_layers is 1"),
        ("Em|ttL", 2, 1, 2, "every MTP layer \\(m\\) after the decoder"),
        ("Et|tm|mL", 2, 2, 3, "all MTP layers \\(m\\) in one stage"),
    ],
)
def test_a_bad_layout_is_one_sentence(
    text: str, layers: int, mtp: int, stages: int, message: str
) -> None:
    with pytest.raises(ScheduleError, match=message):
        check_layout(parse_layout(text), layers, mtp, stages)


@pytest.mark.parametrize(
    ("name", "pp", "microbatches"),
    [("1f1b", 4, 9), ("zb1p", 4, 7), ("dualpipe", 4, 8), ("dualpipev", 4, 10), ("dualpipev", 3, 6)],
)
def test_the_retimer_times_as_the_simulator_does(name: str, pp: int, microbatches: int) -> None:
    rng = random.Random(7)
    schedule = generate(name, pp, microbatches)
    retimer = Retimer(schedule)
    for _ in range(4):
        costs = [
            (rng.random(), rng.random(), rng.random())
            for _ in range(schedule.placement.num_model_stages)
        ]
        a2a = [(rng.choice([0.0, rng.random()]), rng.random()) for _ in costs]
        plain = CostModel(stage_costs=tuple(costs))
        # and with each stage's all-to-all (some stages exchange none, as dense ones)
        streams = CostModel(stage_costs=tuple(costs), stage_a2a=tuple(a2a))
        for cost, exchanged in ((plain, None), (streams, a2a)):
            expected = simulate(schedule, cost)
            makespan, busy = retimer.timed(costs, exchanged)
            assert makespan == pytest.approx(expected.makespan, rel=1e-12)
            assert busy == pytest.approx([r.busy for r in expected.ranks], rel=1e-12)


def _shape(rng: random.Random) -> ModelShape:
    layers, dense = rng.randint(5, 13), rng.randint(0, 2)
    freq = f"[0]*{dense}+[1]*{layers - dense}" if dense else rng.choice([1, 2])
    return ModelShape(
        num_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=rng.choice([16, 64]),
        vocab_size=rng.choice([128, 4096, 32000]),
        ffn_hidden_size=rng.choice([64, 256]),
        swiglu=rng.random() < 0.5,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_layer_freq=freq,
        multi_latent_attention=rng.random() < 0.5,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
        mtp_num_layers=rng.choice([None, 1]),
    )


def _random_case(name: str, seed: int) -> tuple[ModelShape, ParallelSetup]:
    """A random model (:func:`_shape`) and a bf16 setup of ``name`` at PP 2 or 4."""
    rng = random.Random(seed)
    shape = _shape(rng)
    setup = ParallelSetup(
        micro_batch_size=1,
        global_batch_size=12,
        pipeline_schedule=name,
        pipeline_model_parallel_size=rng.choice([2, 4]),
        bf16=True,
    )
    return shape, setup


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", ["1f1b", "zb1p", "dualpipe", "dualpipev"])
def test_the_proposal_is_never_slower_and_stays_within_the_cap(name: str, seed: int) -> None:
    shape, setup = _random_case(name, seed)
    advice = advise(shape, setup)
    assert advice.after.makespan <= advice.before.makespan
    assert advice.after.peak_memory <= advice.memory_cap == advice.before.peak_memory
    # What it proposes is what the config's keys give once set.
    stages = advice.schedule.placement.num_model_stages
    proposed = ParallelSetup(**{**vars(setup), **advice.changes()})
    assert tuple(stages_for(shape, proposed, stages)) == advice.after.stages


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_on_a_profiles_time_the_search_times_as_the_simulator_and_bounds_below(
    name: str, seed: int
) -> None:
    """Timed by a profile (compute rates, all-to-all on MoE layers only): the chosen split's
    step and bubble are the simulator's under the stream cost model, and the search's lower
    bound never exceeds the step of any split it timed (it prunes with it)."""
    shape, setup = _random_case(name, seed)
    timing = StageTiming((1e-9, 1.6e-9, 1e-9), (1.7e-9, 0.9e-9))
    advice = advise(shape, setup, timing=timing)
    for found in (advice.before, advice.after):
        result = simulate(advice.schedule, found.cost_model)
        assert found.cost_model.stage_a2a is not None
        assert found.makespan == pytest.approx(result.makespan, rel=1e-12)
        assert found.bubble == pytest.approx(result.bubble_ratio, rel=1e-9, abs=1e-12)
    search = _Search(shape, setup, advice.schedule, MemorySettings(), timing)
    for stages in {advice.before.stages, advice.after.stages}:
        assert search.lower_bound(stages) <= search.evaluate(stages).makespan * (1 + 1e-12)


def test_a_tighter_memory_cap_is_respected_or_refused_in_one_sentence() -> None:
    shape = ModelShape(
        num_layers=12,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=64,
        vocab_size=32000,
        mtp_num_layers=1,
    )
    setup = ParallelSetup(
        micro_batch_size=1,
        global_batch_size=16,
        pipeline_schedule="dualpipev",
        pipeline_model_parallel_size=4,
    )
    free = advise(shape, setup)
    memories = sorted({c.peak_memory for c in (free.before, free.after)})
    cap = memories[0] * 0.999 if len(memories) == 1 else (memories[0] + memories[1]) / 2
    capped = advise(shape, setup, memory_cap=cap)
    assert capped.after.peak_memory <= cap
    with pytest.raises(ScheduleError, match="no split found fits the memory cap of .*raise"):
        advise(shape, setup, memory_cap=1.0)


def test_progress_is_reported() -> None:
    shape = ModelShape(
        num_layers=10, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=4096
    )
    setup = ParallelSetup(
        micro_batch_size=1,
        global_batch_size=8,
        pipeline_schedule="dualpipev",
        pipeline_model_parallel_size=2,
    )
    lines: list[str] = []
    advise(shape, setup, progress=lines.append)
    assert lines and lines[0].startswith("before: step")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"pipeline_schedule": "interleaved-1f1b"}, "interleaved-1f1b reads first/last counts"),
        ({"global_batch_size": 2}, "dualpipev needs the micro-batches to be >= 2 x PP = 4"),
        ({"world_size": 3}, "world_size: 3 ranks do not split into tensor x pipeline groups"),
        ({"pipeline_schedule": "gpipe"}, "unknown pipeline schedule 'gpipe'"),
    ],
)
def test_a_setup_the_advisor_cannot_use_is_one_sentence(overrides: dict, message: str) -> None:
    shape = ModelShape(
        num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=128
    )
    values = {
        "micro_batch_size": 1,
        "global_batch_size": 8,
        "pipeline_schedule": "dualpipev",
        "pipeline_model_parallel_size": 2,
        **overrides,
    }
    with pytest.raises(ScheduleError, match=message):
        advise(shape, ParallelSetup.from_values(values, "cfg.yaml"))


def test_the_config_split_keys_are_read_as_megatron_and_the_layout_exclusively() -> None:
    shape = ModelShape(
        num_layers=6,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=128,
        mtp_num_layers=1,
    )
    base = dict(
        micro_batch_size=1,
        global_batch_size=8,
        pipeline_schedule="dualpipev",
        pipeline_model_parallel_size=2,
    )
    uneven = ParallelSetup(
        **base, decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=2
    )
    assert stages_for(shape, uneven, 4) == ["Ett", "t", "t", "ttmL"]
    layout = ParallelSetup(**base, pipeline_model_parallel_layout="Et|tt|ttt|mL")
    assert stages_for(shape, layout, 4) == ["Et", "tt", "ttt", "mL"]
    standalone_mtp = ParallelSetup(**base, pipeline_model_parallel_layout="Ett|tt|tt|m|L")
    with pytest.raises(ScheduleError, match="MTP layers \\(m\\) and the loss \\(L\\) in the last"):
        stages_for(shape, standalone_mtp, 5)
    both = ParallelSetup(**{**vars(layout), "decoder_first_pipeline_num_layers": 1})
    with pytest.raises(ScheduleError, match="cannot be combined with first/last"):
        stages_for(shape, both, 4)


@pytest.mark.slow
def test_a_start_over_the_cap_moves_layers_until_it_fits() -> None:
    """torch's ZBV holds more activations than our V: on DeepSeek-V3 at PP=16 no start of
    the search (the most even split, Megatron's first/last counts, the balanced split) fits
    80 GB (74.5 GiB) on every rank, and it said "no split found fits" though some do; now
    it moves layers while that lowers the peak until the split fits, then speeds it up."""
    model = ConfigModel.read(ROOT / "configs" / "deepseek_v3_pp16.yaml", [])
    (zbv,) = [e for e in CATALOG if e.name == "torch-zbv"]
    cap = 74.5 * 2**30
    advice = advise(
        model.shape,
        model.setup,
        schedule="dualpipev",
        microbatches=32,
        memory_cap=cap,
        settings=model.memory_settings(),
        built=zbv.build(16, 32),
    )
    assert advice.before.peak_memory > cap >= advice.after.peak_memory
    assert advice.after.makespan < advice.before.makespan


@pytest.mark.parametrize(
    ("name", "pp", "seed"),
    [("dualpipev", 2, 7), ("dualpipe", 4, 7), ("dualpipev", 2, 12), ("dualpipe", 4, 38)],
)
def test_the_leanest_split_is_found_when_the_cap_allows_only_it(
    name: str, pp: int, seed: int
) -> None:
    """With the cap at the least peak any split has (every split counted), the search
    finds a split within it: moves that lower the memory over the cap, and a few moves
    further where no single one does (these shapes: a descent on the peak, or on the
    memory over the cap alone, stopped short and refused)."""
    shape = _shape(random.Random(seed))
    setup = ParallelSetup(
        micro_batch_size=1,
        global_batch_size=4 * pp,
        pipeline_schedule=name,
        pipeline_model_parallel_size=pp,
    )
    schedule = generate(name, pp, 4 * pp)
    memory = MemoryModel.for_setup(shape, setup, schedule, MemorySettings())
    n, stages = shape.num_layers, schedule.placement.num_model_stages
    splits = [c for c in itertools.product(range(n + 1), repeat=stages) if sum(c) == n]
    least = min(
        max(r.total for r in memory.ranks(tuple(stages_from_counts(list(c), shape.mtp_layers))))
        for c in splits
    )
    advice = advise(shape, setup, memory_cap=least)
    assert advice.after.peak_memory <= least
