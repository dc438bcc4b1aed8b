"""`megatron-dualpipe simulate`: tables, the stable --json shape, pictures, hand-written input."""

import json
import time
from pathlib import Path

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.schedules.registry import generate


def test_simulate_prints_per_rank_figures(capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            [
                "simulate",
                "--schedule",
                "dualpipev",
                "--pp",
                "8",
                "--microbatches",
                "20",
                "--cost",
                "F=1,B=1,W=1,FB=1.6",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "dualpipev: PP=8 micro-batches=20 stages=16" in out
    assert (
        len([line for line in out.splitlines() if line.strip().startswith(tuple("01234567"))]) == 8
    )


def test_json_has_the_documented_shape(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    assert (
        main(
            [
                "simulate",
                "--schedule",
                "dualpipe",
                "--pp",
                "4",
                "--microbatches",
                "8",
                "--cost",
                "F=1,B=1,W=1,FB=2.5",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    data = json.loads(path.read_text())
    assert {"schedule", "pp", "microbatches", "makespan", "bubble_ratio", "ranks"} <= data.keys()
    assert (data["schedule"], data["pp"], data["microbatches"]) == ("dualpipe", 4, 8)
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    rank0 = data["ranks"][0]
    assert {"bubble_ratio", "peak_activations", "actions"} <= rank0.keys()
    starts = [a["start"] for a in rank0["actions"]]
    assert starts == sorted(starts)
    fb = next(a for a in rank0["actions"] if a["kind"] == "FB")
    assert [s["kind"] for s in fb["sub"]] == ["F", "BW"]
    assert {"kind", "stage", "chunk", "microbatch", "start", "end"} <= fb.keys()
    # Each rank of DualPipe runs M forwards: M/2 per direction.
    assert (
        sum(1 for a in rank0["actions"] if a["kind"] == "F")
        + sum(1 for a in rank0["actions"] if a["kind"] == "FB")
        == 8
    )


def test_all_compares_every_schedule(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert (
        main(
            [
                "simulate",
                "--schedule",
                "all",
                "--pp",
                "4",
                "--microbatches",
                "8",
                "--json",
                str(tmp_path / "all.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for name in ("1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev"):
        assert name in out
    assert [d["schedule"] for d in json.loads((tmp_path / "all.json").read_text())] == [
        "1f1b",
        "interleaved-1f1b",
        "zb1p",
        "dualpipe",
        "dualpipev",
    ]


def test_all_notes_schedules_that_do_not_apply(capsys: pytest.CaptureFixture) -> None:
    assert main(["simulate", "--schedule", "all", "--pp", "3", "--microbatches", "6"]) == 0
    assert "dualpipe: not simulated: dualpipe needs an even number of pipeline ranks" in (
        capsys.readouterr().out
    )


def test_png_and_trace_are_written(tmp_path: Path) -> None:
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    assert (
        main(
            [
                "simulate",
                "--schedule",
                "dualpipev",
                "--pp",
                "4",
                "--microbatches",
                "10",
                "--png",
                str(png),
                "--trace",
                str(trace),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(trace.read_text())["traceEvents"]


def test_load_simulates_a_hand_written_schedule(tmp_path: Path, capsys) -> None:
    path = tmp_path / "hand.txt"
    path.write_text(generate("zb1p", 2, 4).to_text())
    assert main(["simulate", "--load", str(path)]) == 0
    assert "zb1p: PP=2 micro-batches=4" in capsys.readouterr().out
    text = path.read_text().replace(" 1W3", "")
    path.write_text(text)
    assert main(["simulate", "--load", str(path)]) == 2
    assert "rank 1: 1B3 has no matching 1W3" in capsys.readouterr().err


def test_load_of_a_text_file_that_is_no_schedule_names_the_file_and_load(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """It said only "line 1: expected the header ...", naming neither."""
    path = tmp_path / "notes.txt"
    path.write_text("hello world\n", encoding="utf-8")
    assert main(["simulate", "--load", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"megatron-dualpipe: error: --load: {path} is not a schedule (line 1: expected the "
        "header 'name=... placement=... ranks=N stages=N microbatches=N'): write one with "
        "simulate --save"
    )


def test_bad_configuration_is_one_sentence(capsys: pytest.CaptureFixture) -> None:
    assert main(["simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "megatron-dualpipe: error: dualpipev needs the micro-batches to be >= 2 x PP = 8, "
        "got 6: change --microbatches or --pp"
    )
    assert main(["simulate", "--cost", "F=1,Q=2"]) == 2
    assert "cannot read cost 'Q=2'" in capsys.readouterr().err


# -- --optimize -------------------------------------------------------------------------


def test_optimize_prints_before_after_and_the_proof_and_saves_a_loadable_schedule(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out, saved = tmp_path / "opt.json", tmp_path / "opt.txt"
    argv = ["simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "8"]
    argv += ["--optimize", "--memory-cap", "8", "--time-limit", "3"]
    assert main([*argv, "--json", str(out), "--save", str(saved)]) == 0
    printed = capsys.readouterr().out
    for words in ("hand-made (dualpipev)", "optimised (dualpipev-opt)", "lower bound 25.5"):
        assert words in printed
    assert "proven gap 0.00%" in printed and "bubble removed vs 1F1B" in printed
    data = json.loads(out.read_text())
    # the simulate --json shape, plus the optimiser's figures
    assert {"schedule", "pp", "microbatches", "makespan", "bubble_ratio", "ranks"} <= data.keys()
    assert data["optimized"] is True
    assert data["baseline_makespan"] == pytest.approx(27.0)  # hand-made DualPipeV, F=B=W
    assert data["makespan"] == pytest.approx(25.5) == pytest.approx(data["lower_bound"])
    assert data["solve_seconds"] > 0 and data["memory_cap"] == [8, 8, 8, 8]
    assert max(r["peak_activations"] for r in data["ranks"]) <= 8
    # 1F1B's bubble is 3 x 3 = 9 units at this size; the optimised step saves 7.5 of it
    assert data["bubble_removed_vs_1f1b"] == pytest.approx((33.0 - 25.5) / 9.0)
    assert (
        main(
            ["simulate", "--load", str(saved), "--cost-per", "stage", "--cost", "F=0.5,B=0.5,W=0.5"]
        )
        == 0
    )
    assert "makespan=25.50" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule", "all", "--optimize"], "--optimize takes one schedule"),
        (["--schedule", "dualpipev", "--memory-cap", "8"], "or, for --memory-cap, --optimize"),
        (["--optimize", "--memory-cap", "8.5"], "--memory-cap is a whole number of activations"),
        (["--optimize", "--config", "configs/tiny_gpt_cpu.yaml"], "--optimize does not apply"),
        (["--schedule", "dualpipev", "--optimize", "--memory-cap", "1"], "too small for the v"),
        (["--schedule", "dualpipev", "--optimize", "--time-limit", "0"], "--time-limit must be"),
    ],
)
def test_optimize_bad_input_is_one_sentence(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["simulate", "--pp", "4", "--microbatches", "8", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plain_simulate_does_not_import_scipy() -> None:
    """Only --optimize needs SciPy (HiGHS); the schedule layer and plain simulate do not."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import megatron_dualpipe.schedules, megatron_dualpipe.planner.optimize\n"
        "from megatron_dualpipe.cli import main\n"
        "assert main(['simulate', '--schedule', 'dualpipev', '--pp', '4']) == 0\n"
        "print('scipy' in sys.modules, 'numpy' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1] == "False False"


# -- --check-nccl ----------------------------------------------------------------------


def test_check_nccl_passes_the_lock_step_plan_on_shared_and_distinct_streams(
    capsys: pytest.CaptureFixture,
) -> None:
    """The runtime's plan is ok for every schedule in the worst case (one stream per rank,
    the default) and with a stream per communicator."""
    base = ["simulate", "--schedule", "all", "--pp", "4", "--microbatches", "8", "--check-nccl"]
    assert main(base) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("NCCL check of")]
    assert len(lines) == 5
    assert all("lock-step plan" in x and "on one stream): ok; 1 communicator," in x for x in lines)
    assert main([*base, "--streams", "distinct"]) == 0
    out = capsys.readouterr().out
    assert out.count("a stream per communicator): ok; 1 communicator,") == 5


def test_check_nccl_beyond_its_bound_is_refused_before_any_work(capsys) -> None:
    """``--check-nccl`` at PP=200 x 1000 took 127 s and 2.8 GB, and 1000 x 2000 ran past
    300 s: it now stops where the optimiser does, at a bound from its measured memory."""
    started = time.monotonic()
    argv = ["simulate", "--schedule", "all", "--pp", "200", "--microbatches", "1000"]
    assert main([*argv, "--check-nccl"]) == 2
    assert time.monotonic() - started < 10.0  # the check itself: over a minute
    assert capsys.readouterr().err == (
        "megatron-dualpipe: error: checking PP=200 x 1000 micro-batches under NCCL's rules "
        "would take about 2.5 GB and 60 s (about 13 KB and 0.3 ms per PP x micro-batch): "
        "--check-nccl takes PP x micro-batches up to 100,000 (about 1.2 GB): lower --pp or "
        "--microbatches\n"
    )
    from megatron_dualpipe.schedules.limits import nccl_check_size_problem

    assert nccl_check_size_problem(100, 1000) is None  # at the bound (about 30 s): checked
    assert nccl_check_size_problem(100, 1001) is not None
