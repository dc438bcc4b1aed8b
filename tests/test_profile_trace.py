"""``simulate --profile``: costs read from a PyTorch profiler trace. The traces here are
written by the tests in the format of DeepSeek's published profile (github
deepseek-ai/profile-data, train.json: record_function spans ``attn(F)``, ..., the launches'
``cudaLaunchKernel`` events matched to kernels by ``args.correlation``, kernels on streams),
with times chosen so that every figure is known; the last test makes a trace with
``train --profile`` on CPU and reads it back."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.planner.config_advice import ConfigModel
from megatron_dualpipe.planner.memory import MemoryModel
from megatron_dualpipe.planner.profile_comparison import twin_schedule
from megatron_dualpipe.planner.profile_config import config_costs, profile_timing, timed_costs
from megatron_dualpipe.planner.profile_report import ProfileRow, deepseek_bubble
from megatron_dualpipe.planner.profile_trace import read_profile
from megatron_dualpipe.planner.schedule_catalog import SCHEDULES as CATALOG
from megatron_dualpipe.schedules import CostModel, ScheduleError, generate, simulate
from megatron_dualpipe.schedules.ir import Action, Kind
from megatron_dualpipe.schedules.layout import parse_layout

ROOT = Path(__file__).resolve().parents[1]
COMPUTE, COMM = 7, 27
#: Per layer, each phase's kernel time (us) and its stream. Compute F 300 (attn 100 + mlp
#: 200), B 600, W 250; all-to-all F 120 + 80, B 90 + 60.
PHASES = (
    ("attn(F)", 100, COMPUTE),
    ("dispatch(F)", 120, COMM),
    ("mlp(F)", 200, COMPUTE),
    ("combine(F)", 80, COMM),
    ("combine(B)", 60, COMM),
    ("mlp(B)", 400, COMPUTE),
    ("mlp(W)", 150, COMPUTE),
    ("dispatch(B)", 90, COMM),
    ("attn(B)", 200, COMPUTE),
    ("attn(W)", 100, COMPUTE),
)
LAYERS = 2


def _trace(gpu: bool = True) -> dict:
    """One overlapped F&B pair (span ``1F1B``) of LAYERS layers. Each phase's CPU span is
    10 us and launches one kernel; each stream runs its kernels back to back from t=1000, so
    the compute stream (1,150 us a layer) is the long one: the pair's wall time is 2,300
    us, its parts sum to 3,000 us (all-to-all 350 us a layer)."""
    events: list[dict] = []
    clock = {COMPUTE: 1000.0, COMM: 1000.0}
    t, correlation = 0.0, 100
    pid, tid = 11, 11
    for _ in range(LAYERS):
        for name, dur, stream in PHASES:
            events.append(_x("user_annotation", name, pid, tid, t, 10.0))
            correlation += 1
            launch = _x("cuda_runtime", "cudaLaunchKernel", pid, tid, t + 2, 3.0)
            launch["args"] = {"correlation": correlation}
            if gpu:
                events.append(launch)
                kernel = _x("kernel", f"k_{name}", 0, stream, clock[stream], float(dur))
                kernel["args"] = {"correlation": correlation, "stream": stream}
                events.append(kernel)
            clock[stream] += dur
            t += 10.0
    events.append(_x("user_annotation", "1F1B", pid, tid, -1.0, t + 2.0))
    events.append(_x("user_annotation", "ProfilerStep#1", pid, tid, -2.0, t + 4.0))
    if not gpu:  # a CPU run: the spans take the times the kernels took above
        events = [e for e in events if e["cat"] == "user_annotation"]
        start = 0.0
        for e, (_, dur, _) in zip(events, PHASES * LAYERS, strict=False):
            e["ts"], e["dur"] = start, float(dur)
            start += dur
    return {"schemaVersion": 1, "traceEvents": events}


def _x(cat: str, name: str, pid: int, tid: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def _write(path: Path, data: dict) -> Path:
    text = json.dumps(data).encode()
    path.write_bytes(gzip.compress(text) if path.suffix == ".gz" else text)
    return path


@pytest.mark.parametrize("name", ["trace.json", "trace.json.gz"])
def test_deepseek_phases_give_the_per_layer_figures(tmp_path: Path, name: str) -> None:
    costs = read_profile(_write(tmp_path / name, _trace()))
    assert costs.device == "GPU" and costs.unit == "layer"
    assert (costs.f, costs.b, costs.w) == pytest.approx((0.3, 0.6, 0.25))
    assert (costs.a2a_forward, costs.a2a_backward) == pytest.approx((0.2, 0.15))
    # Wall: the compute stream's 2 x 1,150 us; parts: every kernel, 1,500 us a layer.
    assert costs.pair_wall == pytest.approx(1.15)
    assert costs.pair_parts == pytest.approx(1.5)
    assert costs.compute_streams == ("7",)
    assert costs.compute_busy == pytest.approx(1.0)
    model = costs.cost_model()
    assert (model.f, model.b, model.w, model.overlap) == pytest.approx(
        (0.5, 0.75, 0.25, 1.15 / 1.5)
    )
    assert (model.a2a_f, model.a2a_b) == pytest.approx((0.2 / 0.5, 0.15 / 0.75))
    phase = costs.phases["mlp(B)"]
    assert (phase.count, phase.ms, phase.streams) == (2, pytest.approx(0.4), {"7": 0.4})
    assert "ProfilerStep#1" not in costs.phases
    # The pair's span holds every kernel of the step, on both streams.
    assert costs.phases["1F1B"].streams == pytest.approx({"27": 0.7, "7": 2.3})


def test_a_cpu_trace_takes_the_spans_own_times_and_says_so(tmp_path: Path) -> None:
    costs = read_profile(_write(tmp_path / "cpu.json", _trace(gpu=False)))
    assert costs.device == "CPU"
    assert costs.notes[0].startswith("no GPU work in the trace")
    assert (costs.f, costs.b, costs.w) == pytest.approx((0.3, 0.6, 0.25))
    assert costs.phases["attn(F)"].streams == {}


def test_simulate_profile_prints_the_figures_and_simulates_on_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write(tmp_path / "t.json", _trace())
    out = tmp_path / "figures.json"
    argv = ["simulate", "--profile", str(trace), "--schedule", "dualpipev", "--pp", "4"]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "F&B pair: wall 1.150 ms vs its parts' sum 1.500 ms (overlap 0.767)" in text
    cost = "F=0.5,B=0.75,W=0.25,overlap=0.766667,a2a_f=0.4,a2a_b=0.2"
    assert f"--cost {cost} --cost-per stage" in text
    figures = json.loads(out.read_text())
    assert figures["phases"]["dispatch(F)"] == {
        "ms": pytest.approx(0.12),
        "count": 2,
        "streams": {"27": pytest.approx(0.12)},
        "cpu_ms": pytest.approx(0.01),
    }
    # The simulated step is the one on those costs, one layer per stage.
    expected = simulate(
        generate("dualpipev", 4, 10), CostModel(f=0.5, b=0.75, w=0.25, overlap=1.15 / 1.5)
    )
    assert figures["makespan"] == pytest.approx(expected.makespan, rel=1e-5)
    # Its compute bound: two stages a rank, 10 micro-batches of the profile's compute,
    # F 0.3 + B 0.6 + W 0.25 ms.
    assert figures["bound"]["compute_bound"] == pytest.approx(2 * 10 * 1.15)


def test_profile_refusals_are_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write(tmp_path / "t.json", _trace())
    assert main(["simulate", "--profile", str(trace), "--cost", "F=1"]) == 2
    assert "--cost and --profile both give the costs: drop one" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    assert main(["simulate", "--profile", str(tmp_path / "bad.json")]) == 2
    assert "is not a Chrome trace" in capsys.readouterr().err
    # Megatron-LM's own traces hold only the profiler's step spans: nothing to read.
    steps = {"traceEvents": [_x("user_annotation", "ProfilerStep#3", 1, 1, 0.0, 5.0)]}
    assert main(["simulate", "--profile", str(_write(tmp_path / "lm.json", steps))]) == 2
    assert "has no phases this reader knows" in capsys.readouterr().err


def test_deepseeks_dualpipe_formula_is_the_simulated_bubble_where_it_holds() -> None:
    """DeepSeek's (PP/2-1)(F&B+B-3W) counts B as the full backward: on even chunks with
    F&B = F+B+W (where the closed form holds on every rank) it is the simulated idle."""
    pp = 8
    result = simulate(generate("dualpipe", pp, 2 * pp), CostModel(f=1, b=1, w=1))
    row = ProfileRow(
        "dualpipe",
        "ours",
        step=result.makespan,
        idle=tuple(r.idle for r in result.ranks),
        chunk=(1.0, 1.0, 1.0),
        pair=3.0,
    )
    formula = deepseek_bubble([row], pp)
    assert formula["formula_ms"] == pytest.approx((pp / 2 - 1) * (3 + 2 - 3))
    assert formula["simulated_idle_ms"]["max"] == pytest.approx(formula["formula_ms"])


def test_a_pair_overlaps_only_where_it_is_shorter_than_its_halves() -> None:
    """What decides the plan's overlap flag: a stage without all-to-all hides nothing, even
    where its parts' sum rounds above the pair's time."""
    assert not ProfileRow("dualpipe", "ours", chunk=(0.1, 0.2, 0.3), pair=0.6).overlaps
    assert ProfileRow("dualpipe", "ours", chunk=(24.3, 27.9, 8.8), pair=32.4).overlaps
    assert not ProfileRow("dualpipe", "ours").overlaps


def test_over_a_config_only_moe_layers_wait_for_an_all_to_all(tmp_path: Path) -> None:
    """DeepSeek-V3's config (its first three layers dense) over the profile: a stage of the
    embedding and the dense layers exchanges nothing, a stage of two MoE layers twice the
    profiled layer's all-to-all, the MTP layer (MoE) once beside the heads; a lone pass
    waits for its own, and a one-layer pair by its streams lasts the profiled pair's wall
    time (the compute stream is the busier)."""
    profile = read_profile(_write(tmp_path / "t.json", _trace()))
    model = ConfigModel.read(ROOT / "configs" / "deepseek_v3_pp16.yaml", [])
    timing = profile_timing(profile, model.shape, model.setup)
    stages = ("Ettt", "tt", "t", "mL")
    cost = timed_costs(timing, model.shape, model.setup, stages, "test").cost
    a2a = (profile.a2a_forward, profile.a2a_backward)
    assert cost.stage_a2a[0] == (0.0, 0.0)
    assert cost.stage_a2a[1] == pytest.approx((2 * a2a[0], 2 * a2a[1]))
    assert cost.stage_a2a[2] == pytest.approx(a2a) == cost.stage_a2a[3]
    assert cost.stage_costs[2] == pytest.approx((profile.f, profile.b, profile.w))

    def same(stage: int) -> int:
        return stage

    lone = cost.duration(Action(Kind.F, 2, 0), 0, same)
    assert lone == pytest.approx(profile.f + profile.a2a_forward)
    dense = cost.duration(Action(Kind.F, 0, 0), 0, same)
    assert dense == pytest.approx(cost.stage_costs[0][0])
    pair = Action.overlapped(Action(Kind.F, 2, 0), Action(Kind.BW, 2, 1))
    assert cost.duration(pair, 0, same) == pytest.approx(profile.pair_wall)


@pytest.mark.parametrize(
    ("peer", "microbatches", "twin"),
    [
        ("interleaved-1f1b-a2a", 8, "interleaved-1f1b"),
        ("torch-1f1b", 8, "1f1b"),
        ("torch-zbv", 6, "dualpipev"),  # fewer than dualpipev takes: its placement all the same
        ("torch-interleaved-zb", 4, "interleaved-1f1b"),
        ("torch-dualpipev", 8, "dualpipev"),
    ],
)
def test_megatrons_and_torchs_schedules_are_advised_under_ours_of_their_placement(
    peer: str, microbatches: int, twin: str
) -> None:
    """The advisor times Megatron's and torch's schedules themselves, over the splits of
    our schedule that places stages as they do, at any micro-batch count they take."""
    (entry,) = [e for e in CATALOG if e.name == peer]
    assert twin_schedule(entry.build(4, microbatches).placement) == twin


def _peak(memory: MemoryModel, stages) -> float:
    return max(r.total for r in memory.ranks(tuple(stages)))


@pytest.mark.slow
def test_profile_beside_a_config_times_each_schedule_at_its_advised_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each schedule at the advisor's split for it on the profile's time within the
    memory cap (every rank within it), no slower than the config's split (dualpipe) or the
    most even one (dualpipev: 4 + 14 x 4 + 1 has no 32-stage form) where those fit."""
    trace = _write(tmp_path / "t.json", _trace())
    config = ROOT / "configs" / "deepseek_v3_pp16.yaml"
    rows, figures = {}, {}
    for name in ("dualpipe", "dualpipev"):
        out = tmp_path / f"{name}.json"
        argv = ["simulate", "--profile", str(trace), "--config", str(config), "--schedule", name]
        argv += ["--microbatches", "32", "--memory-cap", "74.5", "--json", str(out)]
        assert main(argv) == 0
        text = capsys.readouterr().out
        assert "PP=16, 32 micro-batches" in text
        figures[name] = json.loads(out.read_text())
        (rows[name],) = figures[name]["schedules"]
    assert "deepseek_formula" in figures["dualpipe"]
    model = ConfigModel.read(config, [])
    profile = read_profile(trace)
    for name, plain in (("dualpipe", "config's"), ("dualpipev", "most even")):
        row = rows[name]
        assert row["split"] in (plain, "advised") and not row["note"], row
        built = generate(name, 16, 32)
        memory = MemoryModel.for_setup(model.shape, model.setup, built, model.memory_settings())
        assert _peak(memory, parse_layout(row["layout"])) <= 74.5 * 2**30
        timing = profile_timing(profile, model.shape, model.setup)
        before = config_costs(timing, model.shape, model.setup, built.placement)
        assert before.split == plain
        if _peak(memory, before.stages) <= 74.5 * 2**30:  # else the advisor had to leave it
            assert row["step_ms"] <= simulate(built, before.cost).makespan * (1 + 1e-9)
    assert rows["dualpipev"]["split"] == "advised"  # the most even leaves rank 0 long
    for row in rows.values():  # the split's bound: above the even one, under the step
        assert row["compute_bound_ms"] <= row["split_bound_ms"] <= row["step_ms"], row
    # A middle stage of k MoE layers costs k profiled layers (F 0.5, dX 0.75, W 0.25 ms).
    stages = parse_layout(rows["dualpipe"]["layout"])
    middle = stages[len(stages) // 2]
    assert set(middle) == {"t"}
    chunk = figures["dualpipe"]["deepseek_formula"]["chunk_ms"]
    k = len(middle)
    assert (chunk["F"], chunk["dX"], chunk["W"]) == pytest.approx((0.5 * k, 0.75 * k, 0.25 * k))
    with pytest.raises(ScheduleError, match="no phases this reader knows"):
        read_profile(_write(tmp_path / "empty.json", {"traceEvents": []}))


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.multiproc
@pytest.mark.route
def test_the_route_s_profile_writes_a_trace_per_rank_that_simulate_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``train --profile``: Megatron-LM's own profiler, into
    ``<tensorboard_dir>/../torch_profile``, with our executor's spans; without
    ``tensorboard_dir`` refused before any rank. An order optimised on the trace is one the
    route runs (``pipeline_schedule_file``), and one of other micro-batches is refused."""
    sets = ["train_iters=3", "eval_iters=0", "distributed_timeout_minutes=1"]
    sets += ["profile_step_start=1", "profile_step_end=2"]
    command = [sys.executable, "-m", "megatron_dualpipe", "train", "--config"]
    command += [str(ROOT / "configs" / "tiny_gpt_cpu.yaml"), "--profile"]

    def run(*more: str) -> subprocess.CompletedProcess:
        items = [arg for item in (*sets, *more) for arg in ("--set", item)]
        return subprocess.run(
            [*command, *items], cwd=ROOT, capture_output=True, text=True, timeout=600
        )

    refused = run()
    assert (
        refused.returncode == 2
        and "folder named None): set tensorboard_dir" in (refused.stderr.splitlines()[-1])
    ), refused.stderr[-2000:]
    done = run(f"tensorboard_dir={tmp_path / 'tensorboard'}")
    assert done.returncode == 0, done.stderr[-3000:]
    traces = sorted((tmp_path / "torch_profile").iterdir())
    _check_traces(traces, capsys)
    # The route's way to optimise_schedule: the order optimised on the trace, saved, is one
    # the route takes (its check runs in the argument validation a dry run does).
    order = tmp_path / "order.txt"
    simulate = ["simulate", "--profile", str(traces[0]), "--schedule", "dualpipev", "--pp", "2"]
    simulate += ["--microbatches", "8", "--optimize", "--time-limit", "2", "--save", str(order)]
    assert main(simulate) == 0
    saved = order.read_text()
    command[-1] = "--dry-run"
    checked = run(f"pipeline_schedule_file={order}")
    assert checked.returncode == 0 and "dry run of dualpipev" in checked.stdout, checked.stderr
    refused = run(f"pipeline_schedule_file={order}", "global_batch_size=24")
    last = refused.stderr.splitlines()[-1]
    assert last.startswith("error: --pipeline-schedule-file: ") and "12 micro-batches" in last
    assert order.read_text() == saved


def _check_traces(traces: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    """One trace per rank of the tiny config (dualpipev at PP=2, 8 micro-batches, one
    profiled step): rank 0's spans are its actions, by kind, and simulate reads it."""
    assert [t.name for t in traces] == ["rank-0.json.gz", "rank-1.json.gz"]
    costs = read_profile(traces[0])
    assert costs.device == "CPU" and costs.spelling == "executor"
    kinds: dict[str, int] = {}
    for name, phase in costs.phases.items():
        if " stage=" in name:  # the profiler's own spans (gloo:send, ...) are there too
            kinds[name.split(" ")[0]] = kinds.get(name.split(" ")[0], 0) + phase.count
    schedule = generate("dualpipev", 2, 8)
    expected: dict[str, int] = {}
    for action in schedule.ranks[0]:
        kind = action.kind.value
        expected[kind] = expected.get(kind, 0) + 1
        for half in action.sub:
            expected[f"FB/{half.kind.value}"] = expected.get(f"FB/{half.kind.value}", 0) + 1
    assert kinds == expected
    assert costs.f > 0 and costs.b > 0 and costs.w > 0 and costs.pair_wall is not None
    capsys.readouterr()
    assert main(["simulate", "--profile", str(traces[0]), "--pp", "2", "--microbatches", "8"]) == 0
    assert "ms per stage" in capsys.readouterr().out


def test_the_bench_suite_keeps_the_deepseek_section_when_it_rewrites_the_page() -> None:
    from bench.suite import DEEPSEEK_TITLE, _document, replace_section

    page = "# Benchmarks\n\nhead\n\n## Simulated\n\nold table\n\n## GPU checks\n\nnot run\n"
    page = replace_section(page, DEEPSEEK_TITLE, "per layer: F 24.3 ms")
    titles = [line for line in page.splitlines() if line.startswith("## ")]
    assert titles == ["## Simulated", f"## {DEEPSEEK_TITLE}", "## GPU checks"]
    # Written again: replaced in place, not added twice.
    again = replace_section(page, DEEPSEEK_TITLE, "per layer: F 25.0 ms")
    assert again.count(DEEPSEEK_TITLE) == 1 and "25.0 ms" in again and "24.3" not in again
    rewritten = _document([], quick=True, elapsed=1.0, kept=page)
    assert f"## {DEEPSEEK_TITLE}\n\nper layer: F 24.3 ms\n" in rewritten
    assert rewritten.index(DEEPSEEK_TITLE) < rewritten.index("## GPU checks")
    assert DEEPSEEK_TITLE not in _document([], quick=True, elapsed=1.0)


def _profiled_span_names(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    """One dualpipev step on two gloo ranks under torch.profiler, with the executor's spans
    off, then on: the spans of this rank's actions each time."""
    import torch
    from torch import nn

    from megatron_dualpipe.runtime import PipelineExecutor, TensorSpec

    torch.manual_seed(0)
    schedule = generate("dualpipev", world_size, 4)
    modules = [nn.Linear(4, 4) for _ in range(2)]
    spec = TensorSpec((2, 4), torch.float32)
    executor = PipelineExecutor(
        schedule,
        rank,
        modules,
        specs=dict.fromkeys(range(schedule.placement.num_stages), spec),
        loss_fn=lambda out, mb: out.sum(),
        timeout_s=30.0,
    )
    inputs = {mb: torch.randn(2, 4) for mb in range(4)} if rank == 0 else {}
    names = []
    for on in (False, True):
        executor.record_spans = on
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            executor.run(inputs)
        names.append(sorted(e.name for e in prof.events() if " stage=" in e.name))
    executor.close()
    return names[0], names[1]


@pytest.mark.multiproc
def test_the_executor_spans_each_action_only_when_asked() -> None:
    from tests.multiproc import run_workers

    schedule = generate("dualpipev", 2, 4)
    for rank, (off, on) in enumerate(run_workers(_profiled_span_names, 2)):
        assert off == []
        expected = []
        for action in schedule.ranks[rank]:
            if action.kind.value == "FB":
                forward, backward = action.sub
                expected.append(
                    f"FB stage={forward.stage} mb={forward.microbatch} + "
                    f"stage={backward.stage} mb={backward.microbatch}"
                )
                expected += [
                    f"FB/{h.kind.value} stage={h.stage} mb={h.microbatch}" for h in action.sub
                ]
            else:
                expected.append(f"{action.kind.value} stage={action.stage} mb={action.microbatch}")
        assert on == sorted(expected)


def test_simulate_profile_optimises_on_the_profiles_costs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write(tmp_path / "t.json", _trace())
    out = tmp_path / "opt.json"
    argv = ["simulate", "--profile", str(trace), "--optimize", "--schedule", "dualpipev"]
    argv += ["--pp", "2", "--microbatches", "4", "--time-limit", "5", "--json", str(out)]
    assert main(argv) == 0
    assert "overlap 0.767" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["optimized"] is True and figures["phases"]["attn(F)"]["count"] == 2
    # No better than the hand-made schedule's bound on these costs, no worse than it.
    hand = simulate(
        generate("dualpipev", 2, 4), CostModel(f=0.5, b=0.75, w=0.25, overlap=1.15 / 1.5)
    )
    assert figures["lower_bound"] <= figures["makespan"] <= hand.makespan * (1 + 1e-5)


def test_a_broken_event_is_one_sentence(tmp_path: Path) -> None:
    data = _trace()
    del data["traceEvents"][0]["dur"]
    with pytest.raises(ScheduleError, match="has an event without a readable 'dur'"):
        read_profile(_write(tmp_path / "broken.json", data))


def test_megatron_s_interleaved_is_compared_at_its_fastest_virtual_stage_count(
    tmp_path: Path,
) -> None:
    """Megatron's interleaved 1F1B with its all-to-all overlap, each at the advisor's split:
    at 2, 3 and 4 virtual stages per rank, the row kept is the fastest, and it says what the
    others took."""
    from megatron_dualpipe.planner.profile_comparison import profile_comparison
    from megatron_dualpipe.planner.schedule_catalog import VIRTUAL_STAGES

    profile = read_profile(_write(tmp_path / "t.json", _trace()))
    model = ConfigModel.read(ROOT / "configs" / "tiny_deepseek_cpu.yaml", [])
    _, figures = profile_comparison(
        profile, model, schedule="all", microbatches=8, latency=0.0, memory_cap_gib=80
    )
    (row,) = [r for r in figures["schedules"] if r["schedule"] == "interleaved-1f1b-a2a"]
    kept = row["model_stages"] // 2
    tried = dict(re.findall(r"VP=(\d) ([\d.]+) ms", row["note"]))
    assert row["note"].startswith(f"VP={kept}, the fastest (also tried: ")
    assert sorted([kept, *map(int, tried)]) == list(VIRTUAL_STAGES)
    assert all(float(step) >= round(row["step_ms"], 1) for step in tried.values())


def test_the_plan_under_the_table_trains_the_fastest_schedule_at_the_split_it_was_timed_at(
    tmp_path: Path,
) -> None:
    """``simulate --profile --config --schedule all``: the plan names the fastest schedule
    that trains on Megatron (not torch's), against Megatron's interleaved-1f1b-a2a; its
    lines, set on the config, time that schedule (by the table's name) at the same step."""
    from megatron_dualpipe.planner.profile_comparison import profile_comparison

    profile = read_profile(_write(tmp_path / "t.json", _trace()))
    config = ROOT / "configs" / "tiny_deepseek_cpu.yaml"
    model = ConfigModel.read(config, [])
    options = dict(microbatches=8, latency=0.0, memory_cap_gib=80)
    lines, figures = profile_comparison(profile, model, schedule="all", **options)
    trained = [r for r in figures["schedules"] if r["source"] != "torch" and r["step_ms"]]
    best = min(trained, key=lambda r: r["step_ms"])
    plan = lines.index(next(line for line in lines if line.startswith("\nplan: ")))
    assert lines[plan].startswith(f"\nplan: {best['schedule']} at the {best['split']} split ")
    flags = next(i for i, line in enumerate(lines) if line.startswith("or give Megatron-LM's "))
    pasted = [line.strip() for line in lines[plan + 1 : flags]]
    assert "  overlap_moe_expert_parallel_comm: true" in lines  # the trace's F&B pairs overlap
    assert "--overlap-moe-expert-parallel-comm" in lines[flags]
    assert lines[-1].startswith("overlap_moe_expert_parallel_comm needs bf16 or fp16, ")
    overrides = [line.replace(": ", "=", 1).replace('"', "") for line in pasted]
    again = ConfigModel.read(config, overrides)
    name = best["schedule"]
    assert again.setup.num_microbatches == 8 != model.setup.num_microbatches  # in the lines
    unset = options | {"microbatches": None}  # the config's, as the lines set it
    _, timed = profile_comparison(profile, again, schedule=name, **unset)
    (row,) = timed["schedules"]
    assert row["step_ms"] == pytest.approx(best["step_ms"], rel=1e-9)


def test_a_schedule_with_no_split_within_the_memory_cap_is_named_never_planned(
    tmp_path: Path,
) -> None:
    """Under a cap only dualpipe (two copies of the model) exceeds, its row is timed at the
    config's own split (here the most even) but the plan trains the fastest schedule that
    fits, naming dualpipe as faster but over the cap (it planned dualpipe, at DeepSeek-V3's
    PP=8 split that needs 85.3 GiB under a 74.5 GiB cap); under a cap none fits, the plan
    says so in one sentence."""
    from megatron_dualpipe.planner.profile_comparison import profile_comparison

    profile = read_profile(_write(tmp_path / "t.json", _trace()))
    model = ConfigModel.read(ROOT / "configs" / "tiny_deepseek_cpu.yaml", [])

    def compare(cap: float) -> tuple[str, dict[str, dict]]:
        lines, figures = profile_comparison(
            profile, model, schedule="all", microbatches=8, latency=0.0, memory_cap_gib=cap
        )
        plan = [line for line in lines if line.startswith("\nplan: ")]
        return "".join(plan), {r["schedule"]: r for r in figures["schedules"]}

    _, lean = compare(1e-12)  # every row's note: what its leanest split needs
    needs = {
        name: float(re.search(r"the leanest needs ([\d.e-]+) GiB", r["note"]).group(1))
        for name, r in lean.items()
        if r["source"] != "torch"
    }
    others = max(need for name, need in needs.items() if name != "dualpipe")
    assert needs["dualpipe"] > others
    plan, rows = compare((needs["dualpipe"] + others) / 2)
    assert not rows["dualpipe"]["fits"]
    fitting = [r for r in rows.values() if r["source"] != "torch" and r["fits"]]
    best = min(fitting, key=lambda r: r["step_ms"])
    assert rows["dualpipe"]["step_ms"] < best["step_ms"]  # faster, yet not planned
    assert plan.startswith(f"\nplan: {best['schedule']} at the {best['split']} split ")
    faster = "(faster, but with no split found within the memory cap: dualpipe ("
    assert faster in plan
    plan, rows = compare(1e-12)
    assert not any(r["fits"] for r in rows.values())
    assert plan == (
        "\nplan: none: no schedule here has a split found within the memory cap (each row's "
        "note says what its leanest needs): raise --memory-cap"
    )
