"""Small things a first hour with the commands ran into: two outputs of ``simulate`` never
share a file, ``train --help`` says what the config keys are, Megatron-Core's compiled
functions run eagerly on CPU ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dualpipe.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_two_simulate_outputs_naming_one_file_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    assert main(["simulate", "--trace", str(out), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--trace and --json both name {out}: one would overwrite the other" in err
    assert not out.exists()


def test_train_help_says_what_the_config_keys_are(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "config keys (YAML or --set): Megatron-LM's arguments in snake case" in text
    assert "pipeline_schedule" in text and "world_size" in text


@pytest.mark.megatron
def test_train_ranks_on_cpu_run_torch_compile_functions_eagerly() -> None:
    """Megatron-Core's jit_fuser is torch.compile; on CPU its first call compiled C++ in
    iteration 1 (11-19 s of tiny_deepseek_cpu.yaml's first iteration). Inside the context
    Megatron-LM's loop runs its CPU ranks in nothing compiles, and outside it (under torch's
    default stance: this test session runs eagerly, tests/conftest.py) the same function
    still does."""
    import torch

    from megatron_dualpipe.megatron.compat.cpu_compat_training import eager_on_cpu

    compiled: list[int] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        compiled.append(len(example_inputs))
        return graph.forward

    @torch.compile(backend=backend)
    def fused(x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) * x + 1

    x = torch.arange(4.0)
    with eager_on_cpu():
        assert torch.equal(fused(x), torch.sigmoid(x) * x + 1)
    assert compiled == []
    with torch.compiler.set_stance("default"):
        fused(x)
    assert compiled == [1]


@pytest.mark.megatron
def test_the_timelines_prediction_runs_the_order_the_ranks_ran() -> None:
    """An FB that ran as its forward half and then its backward half is two actions in the
    measured step, and the simulated step beside it runs those two, not an FB pair."""
    from megatron_dualpipe.planner.measured_step import predict
    from megatron_dualpipe.schedules.cost import CostModel
    from megatron_dualpipe.schedules.ir import Kind
    from megatron_dualpipe.schedules.registry import generate
    from megatron_dualpipe.schedules.simulate import RankStats, SimResult, TimedAction, simulate

    schedule, cost = generate("dualpipev", 2, 4), CostModel(f=1.0, b=1.0, w=0.5)
    ranks = []
    for stats in simulate(schedule, cost).ranks:
        ran = []
        for timed in stats.actions:
            if timed.action.kind is Kind.FB:
                forward, backward = timed.action.sub
                mid = timed.start + cost.f
                ran += [
                    TimedAction(forward, timed.start, mid),
                    TimedAction(backward, mid, timed.end),
                ]
            else:
                ran.append(timed)
        ranks.append(RankStats(stats.rank, ran, stats.busy, stats.peak_activations))
    assert any(t.action.kind is Kind.FB for t in simulate(schedule, cost).ranks[0].actions)
    measured = SimResult(schedule, cost, max(t.end for r in ranks for t in r.actions), ranks, [])
    predicted = predict(measured)
    assert [[t.action for t in r.actions] for r in predicted.ranks] == [
        [t.action for t in r.actions] for r in ranks
    ]
