"""The benchmark code: the simulated grid's rows and files, the sleep model's separate dX
and dW passes, the rank launcher and a tiny run of the measured peers. No timed
assertions: sleeps are checked by which ones ran, not by how long they took."""

import json
from pathlib import Path

import pytest
import torch

from bench import simulated, suite
from bench.__main__ import main
from bench.launch import BenchError, run_ranks
from bench.profiles import PROFILES
from bench.simulated import LOWER_BOUND, simulate_cell, simulated_table
from bench.sleep_model import SleepClock, SleepCosts, SleepLinear, SleepStage
from megatron_dualpipe.planner.optimize import Effort
from megatron_dualpipe.planner.schedule_catalog import SCHEDULES

# -- simulated ---------------------------------------------------------------------------


@pytest.mark.parametrize("profile", PROFILES, ids=[p.key for p in PROFILES])
def test_a_cell_has_every_schedule_and_sane_ratios(profile) -> None:
    rows = simulate_cell(profile, 4, 8)
    assert [r.schedule for r in rows] == [e.name for e in SCHEDULES] + [LOWER_BOUND]
    for r in rows:
        assert not r.note, r.note
        assert 0 < r.vs_1f1b <= 1.5
        assert 0 <= r.bubble_ratio < 1
        assert r.busiest <= r.makespan + 1e-9
    by_name = {r.schedule: r for r in rows}
    assert by_name["1f1b"].vs_1f1b == 1.0
    assert by_name["torch-1f1b"].makespan == by_name["1f1b"].makespan
    assert by_name["dualpipe"].param_factor == 2.0
    assert by_name["1f1b"].peak_activations == 4  # PP 1F1B stages on rank 0
    assert by_name["dualpipev"].peak_activations == 4.5  # 2PP+1 half-size stages
    bound = by_name[LOWER_BOUND].makespan
    assert all(bound <= r.makespan + 1e-9 for r in rows)


def test_every_line_of_the_bubble_figure_has_a_colour_of_its_own() -> None:
    """13 lines (the hand schedules, torch's and three optimiser rows) had 10 colours."""
    from dataclasses import replace

    from matplotlib.colors import to_hex

    from bench.plots import bubble_figure

    rows = [r for m in (8, 16) for r in simulate_cell(PROFILES[0], 4, m)]
    optimised = [
        replace(r, schedule=f"{r.schedule}-opt", source="optimised")
        for r in rows
        if r.schedule in ("dualpipev", "zb1p", "dualpipe")
    ]
    lines = bubble_figure([*rows, *optimised], "F=B=W").axes[0].get_lines()
    assert len(lines) == len(SCHEDULES) + 3 == 13
    assert len({to_hex(line.get_color()) for line in lines}) == 13
    dashed = {line.get_label() for line in lines if line.get_linestyle() == "--"}
    assert dashed == {e.name for e in SCHEDULES if e.source == "torch"}


def test_an_illegal_cell_is_a_note_not_a_failure() -> None:
    rows = simulate_cell(PROFILES[0], 4, 6)  # dualpipe(v) need 8, interleaved a multiple of 4
    notes = {r.schedule for r in rows if r.note}
    assert {"dualpipe", "dualpipev", "torch-dualpipev", "interleaved-1f1b"} <= notes
    assert "n/a" in simulated_table(rows, PROFILES[0])


def _column(table: str, name: str) -> dict[str, list[str]]:
    """Per schedule of a simulated markdown table, its cells under every header ``name``
    (one per micro-batch count)."""
    header, _, *body = [line for line in table.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in [header, *body]]
    at = [i for i, c in enumerate(cells[0]) if c == name]
    return {row[0]: [row[i] for i in at] for row in cells[1:]}


def test_every_schedule_row_is_set_against_its_compute_bound_by_hand() -> None:
    """F=B=W=1 per rank share: 3 of compute per micro-batch on every rank under every
    schedule, 24 at m=8 and 48 at m=16; each row's "vs compute bound" is its T over that,
    and the lower-bound row (the least busiest rank) has none."""
    rows = [r for m in (8, 16) for r in simulate_cell(PROFILES[0], 4, m)]
    for r in rows:
        if r.schedule == LOWER_BOUND:
            assert (r.compute_bound, r.vs_bound) == (None, None)
        else:
            assert r.compute_bound == 3.0 * r.microbatches
            assert r.vs_bound == r.makespan / r.compute_bound
    table = simulated_table(rows, PROFILES[0])
    cells = _column(table, "vs compute bound")
    makespans = {(r.schedule, r.microbatches): r.makespan for r in rows}
    for name in (e.name for e in SCHEDULES):
        expected = [f"{makespans[(name, m)] / (3.0 * m):.2f}x" for m in (8, 16)]
        assert cells[name] == expected, name
    assert makespans[("1f1b", 8)] == 33.0 and cells["1f1b"] == ["1.38x", "1.19x"]
    assert cells[LOWER_BOUND] == ["-", "-"]
    bound_line = "- compute bound (T; mean over the schedules, range): "
    assert bound_line + "24.00 (24.00-24.00) at m=8, 48.00 (48.00-48.00) at m=16" in table


def test_the_compute_bound_follows_each_schedules_own_stages() -> None:
    """Ends 1.5x: 1F1B's 4 model stages cost (1.5 + 1 + 1 + 1.5) x 3 = 15 per micro-batch,
    8 micro-batches over 4 ranks: 30; DualPipeV's 8 half-size stages (0.75 x 2 + 0.5 x 6)
    x 3 = 13.5: 27. Overlapped pairs leave the bound alone (their parts' compute) and can
    take less than it: DualPipeV under F&B=0.7 is below 1x."""
    uneven, overlap = simulated.profile_by_key("uneven"), simulated.profile_by_key("moe-overlap")
    rows = {r.schedule: r for r in simulate_cell(uneven, 4, 8)}
    assert (rows["1f1b"].compute_bound, rows["dualpipev"].compute_bound) == (30.0, 27.0)
    assert rows["dualpipev"].vs_bound == pytest.approx(rows["dualpipev"].makespan / 27.0)
    table = simulated_table(list(rows.values()), uneven)
    assert f"{rows['1f1b'].makespan / 30.0:.2f}x" == _column(table, "vs compute bound")["1f1b"][0]
    assert "(27.00-30.00) at m=8" in table
    paired = {r.schedule: r for r in simulate_cell(overlap, 4, 8)}
    assert paired["dualpipev"].compute_bound == 24.0
    assert paired["dualpipev"].vs_bound == paired["dualpipev"].makespan / 24.0 < 1.0


@pytest.mark.slow
def test_quick_bench_writes_tables_figures_and_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(suite, "SIM_PPS_QUICK", (4,))
    monkeypatch.setattr(suite, "SIM_MICROBATCH_MULTIPLES", (2, 4))
    monkeypatch.setattr(
        simulated, "OPTIMISER_EFFORT", Effort(builds=4, evaluations=20, milp_nodes=20)
    )
    out, data = tmp_path / "out", tmp_path / "bench.json"
    argv = ["--quick", "--only", "simulated", "--out", str(out), "--json", str(data)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "**F=B=W, PP=4**" in printed and "torch-dualpipev" in printed
    payload = json.loads(data.read_text())
    rows = payload["sections"]["simulated"]["rows"]
    plain = [r for r in rows if r["source"] != "optimised"]
    assert len(plain) == len(PROFILES) * 2 * (len(SCHEDULES) + 1)
    optimised = [r for r in rows if r["source"] == "optimised"]
    names = {r["schedule"].split(",")[0] for r in optimised}
    assert names == {name for name, _ in simulated.OPTIMISED}
    assert all(0 <= r["gap"] < 1 and r["proven_bound"] <= r["makespan"] + 1e-9 for r in optimised)
    assert all(0 < r["vs_1f1b"] <= 1.5 for r in rows)
    scheduled = [r for r in rows if r["source"] != "bound"]
    assert all(r["vs_bound"] == r["makespan"] / r["compute_bound"] for r in scheduled)
    equal = [r for r in scheduled if r["profile"] == "equal"]
    assert all(r["compute_bound"] == 3.0 * r["microbatches"] for r in equal)
    assert "bubble removed vs 1F1B" in printed and "proven gap" in printed
    for profile in PROFILES:
        assert (out / f"bench_sim_bubble_{profile.key}.png").stat().st_size > 0
    doc = (out / "BENCHMARKS.md").read_text()
    assert "## Simulated" in doc and "bench_sim_bubble_equal.png" in doc


# -- sleep model -------------------------------------------------------------------------

COSTS = SleepCosts(f=0.001, b=0.002, w=0.003)


def _kinds(clock: SleepClock) -> list[str]:
    kinds = [k for k, _, _ in clock.events]
    clock.reset()
    return kinds


def test_sleep_linear_splits_dx_and_dw_passes_and_matches_linear() -> None:
    torch.manual_seed(0)
    clock = SleepClock(record=True)
    layer = SleepLinear(5, 3, COSTS, clock)
    plain = torch.nn.Linear(5, 3)
    plain.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x = torch.randn(4, 2, 5, requires_grad=True)
    grad_out = torch.randn(4, 2, 3)

    y = layer(x)
    assert _kinds(clock) == ["F"]
    torch.testing.assert_close(y, plain(x))

    (dx,) = torch.autograd.grad(y, x, grad_out, retain_graph=True)
    assert _kinds(clock) == ["B"]  # the input-gradient pass sleeps dX only
    dw, db = torch.autograd.grad(y, (layer.weight, layer.bias), grad_out)
    assert _kinds(clock) == ["W"]  # the weight pass sleeps dW only

    ref = plain(x)
    ref_dx, ref_dw, ref_db = torch.autograd.grad(ref, (x, plain.weight, plain.bias), grad_out)
    torch.testing.assert_close(dx, ref_dx)
    torch.testing.assert_close(dw, ref_dw)
    torch.testing.assert_close(db, ref_db)


def test_sleep_stage_has_an_input_gradient_path_without_input_grad() -> None:
    clock = SleepClock(record=True)
    stage = SleepStage(layers=2, width=4, costs=COSTS, clock=clock)
    y = stage(torch.randn(3, 4))  # the input needs no gradient, as on a first stage
    assert _kinds(clock) == ["F", "F"]
    torch.autograd.grad(y.sum(), stage.entry, retain_graph=True)
    assert _kinds(clock) == ["B", "B"]
    y.sum().backward()  # a full backward runs both nodes of both layers
    assert sorted(_kinds(clock)) == ["B", "B", "W", "W"]


def test_sleep_linear_defers_dw_to_our_weight_grad_store() -> None:
    from megatron_dualpipe.runtime.weight_grad_store import WeightGradStore

    torch.manual_seed(1)
    clock, store = SleepClock(record=True), WeightGradStore()
    layer = SleepLinear(5, 3, COSTS, clock)
    plain = torch.nn.Linear(5, 3)
    plain.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x = torch.randn(4, 5, requires_grad=True)
    grad_out = torch.randn(4, 3)
    with store.active():
        y = layer(x)
    _kinds(clock)
    with store.capture("mb0"):
        y.backward(grad_out)  # our executor's B: one full backward while capturing
    assert _kinds(clock) == ["B"] and layer.weight.grad is None and len(store) == 1
    store.run("mb0")  # its W
    assert _kinds(clock) == ["W"]
    plain(x).backward(grad_out)
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad)
    torch.testing.assert_close(layer.bias.grad, plain.bias.grad)
    assert list(layer.deferred_parameters()) == [layer.weight, layer.bias]


# -- launcher and measured peers ---------------------------------------------------------


def _all_reduce_rank(rank: int, world_size: int, scale: int) -> float:
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return scale * t.item()


def _failing_rank(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank one gives up")


def test_run_ranks_returns_results_in_rank_order() -> None:
    assert run_ranks(_all_reduce_rank, 2, (10,), timeout_s=60) == [10.0, 10.0]


def test_run_ranks_names_the_failing_rank() -> None:
    with pytest.raises(BenchError, match="(?s)rank 1 of 2 failed.*rank one gives up"):
        run_ranks(_failing_rank, 2, timeout_s=60, pg_timeout_s=5)


def test_measured_peers_run_end_to_end_tiny() -> None:
    from bench.peers import PeerConfig, measure_peers, peers_table

    config = PeerConfig(pp=2, microbatches=4, share_ms=1.0, steps=1, warmup=1, timeout_s=120)
    results = measure_peers(config)
    assert [r.schedule for r in results] == list(config.schedules)
    for r in results:
        assert len(r.step_ms_all) == 1 and len(r.busy_ms) == 2 and r.ratio > 0
        assert r.simulated_busy_ms == pytest.approx(4 * 3 * 1.0)
    assert "torch-zbv" in peers_table(results)
