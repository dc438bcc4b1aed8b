"""`megatron-dualpipe simulate --config`: the balance advisor's proposals for DeepSeek-V3's shape
at PP16 (dualpipev and dualpipe) and for a tiny DeepSeek-shaped CPU config, never slower than
the even split and within the memory cap, with config lines that load back; bad input is one
sentence.

The two configs live in tests/data/ until configs/deepseek_v3_pp16.yaml and
configs/tiny_deepseek_cpu.yaml carry the keys these shapes need."""

from __future__ import annotations

import io
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_dualpipe.cli import main
from megatron_dualpipe.planner.advisor import ParallelSetup, stages_for
from megatron_dualpipe.planner.model_cost import ModelShape
from megatron_dualpipe.schedules.config_values import read_values
from megatron_dualpipe.schedules.layout import format_layout

DATA = Path(__file__).parent / "data"
DEEPSEEK, TINY = DATA / "deepseek_v3_pp16.yaml", DATA / "tiny_deepseek_cpu.yaml"


def _advise(config: Path, tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "advice.json"
    buffer = io.StringIO()
    from contextlib import redirect_stdout

    with redirect_stdout(buffer):
        assert main(["simulate", "--config", str(config), "--json", str(out), *extra]) == 0
    return json.loads(out.read_text()), buffer.getvalue()


def _with_pasted_lines(config: Path, text: str, tmp_path: Path) -> Path:
    """``config`` with the printed paste lines applied, as a user would."""
    lines = text.split("paste into", 1)[1].splitlines()[1:]
    block = list(itertools.takewhile(lambda line: line.startswith("  "), lines))
    pasted = yaml.safe_load("\n".join(block))  # the indented lines right under it
    values = {**yaml.safe_load(config.read_text()), **pasted}
    path = tmp_path / config.name
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def _stages(config: Path) -> list[str]:
    values = read_values(config)
    shape = ModelShape.from_values(values, str(config))
    setup = ParallelSetup.from_values(values, str(config))
    from megatron_dualpipe.schedules.registry import spec

    found = spec(setup.pipeline_schedule)
    return stages_for(shape, setup, found.model_stages(setup.pipeline_model_parallel_size))


@pytest.mark.parametrize(
    ("schedule", "layout", "line"),
    [
        pytest.param(
            "dualpipev",
            "Et|(tt|)*30,mL",
            'pipeline_model_parallel_layout: "Et|(tt|)*30,mL"',
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "dualpipe",
            "Et*4|(t*4|)*14,tmL",
            "decoder_last_pipeline_num_layers: 1",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_deepseek_v3_proposal(schedule: str, layout: str, line: str, tmp_path: Path) -> None:
    advice, text = _advise(DEEPSEEK, tmp_path, "--schedule", schedule)
    assert advice["before"]["label"] == "most even split"  # 61 layers: no even cut exists
    assert advice["after"]["layout"] == layout
    assert sum(advice["after"]["layers_per_stage"]) == 61
    assert advice["after"]["step"] < advice["before"]["step"]
    assert advice["gain"] > 1.1
    assert max(advice["after"]["memory_per_rank"]) <= advice["memory_cap"]
    assert f"  {line}" in text.splitlines()
    # The lines, pasted, give the proposed stages, and the advisor then keeps them.
    pasted = _with_pasted_lines(DEEPSEEK, text, tmp_path)
    assert format_layout(_stages(pasted)) == layout
    again, text = _advise(pasted, tmp_path, "--schedule", schedule)
    assert again["before"]["step"] == pytest.approx(advice["after"]["step"])
    assert "keep the config's split" in text


def test_tiny_deepseek_proposal_loads_back(tmp_path: Path) -> None:
    # The proposal holds about 1 KiB more than the most even split on rank 1 (the final norm
    # sits with the last decoder layer, stage 2, when the loss's stage holds MTP only): a
    # cap just above the even split's peak lets it in.
    advice, text = _advise(TINY, tmp_path, "--memory-cap", "0.00336")
    assert advice["after"]["layout"] == "Ett|tt|tt|mL"
    assert (advice["schedule"], advice["pp"], advice["model_stages"]) == ("dualpipev", 2, 4)
    assert advice["after"]["step"] <= advice["before"]["step"]
    assert max(advice["after"]["memory_per_rank"]) <= advice["memory_cap"]
    pasted = _with_pasted_lines(TINY, text, tmp_path)
    assert format_layout(_stages(pasted)) == advice["after"]["layout"]
    assert "MLA, MTP 1" in text and "5 MoE: 4 experts top-2 + shared expert" in text


@pytest.mark.megatron
@pytest.mark.route
def test_pasted_lines_are_megatron_lm_s_arguments_with_the_advised_values(tmp_path: Path) -> None:
    """The config with the advisor's lines pasted in, as ``train`` hands it to Megatron-LM's
    parser (read in a process of its own: this one must not import megatron.training)."""
    advice, text = _advise(TINY, tmp_path)
    pasted = _with_pasted_lines(TINY, text, tmp_path)
    code = (
        "import json, sys, warnings; warnings.simplefilter('ignore'); "
        "from megatron_dualpipe.megatron.lm_args import megatron_lm_argv, megatron_lm_parser; "
        "from megatron_dualpipe.schedules.config_values import read_values; "
        "p = megatron_lm_parser(); "
        "args = p.parse_args(megatron_lm_argv(read_values(sys.argv[1]), p, sys.argv[1])); "
        "print(json.dumps({k: getattr(args, k) for k in json.loads(sys.argv[2])}))"
    )
    changes = advice["changes"]
    done = subprocess.run(
        [sys.executable, "-c", code, str(pasted), json.dumps(sorted(changes))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == changes


@pytest.mark.slow
@pytest.mark.megatron
def test_megatron_core_accepts_the_proposed_layout(tmp_path: Path) -> None:
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    advice, _ = _advise(DEEPSEEK, tmp_path)
    layout = PipelineParallelLayerLayout(advice["after"]["layout"], 16)
    layout.validate_layer_layout(num_layers=61, mtp_num_layers=1)
    assert len(layout.flatten_layout) == 61 + 1 + 2  # layers, MTP, embedding and loss


@pytest.mark.slow
def test_memory_cap_in_gib_and_pictures(tmp_path: Path) -> None:
    loose, _ = _advise(TINY, tmp_path)
    cap_gib = max(loose["before"]["memory_per_rank"]) / 2**30
    png = tmp_path / "split.png"
    advice, text = _advise(TINY, tmp_path, "--memory-cap", f"{cap_gib:.9f}", "--png", str(png))
    assert advice["memory_cap"] == pytest.approx(cap_gib * 2**30)
    assert max(advice["after"]["memory_per_rank"]) <= advice["memory_cap"]
    for label in ("before", "after"):
        assert (tmp_path / f"split_{label}.png").read_bytes()[:4] == b"\x89PNG"
    assert "(the peak of the most even split)" not in text


def test_progress_shows_on_a_terminal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr("sys.stderr", terminal)
    _advise(TINY, tmp_path)
    written = terminal.getvalue()
    assert "\r\x1b[Kbefore: step" in written
    assert written.endswith("\r\x1b[K")  # cleared before the results print


def test_a_split_that_does_not_load_is_named_and_replaced(tmp_path: Path) -> None:
    advice, text = _advise(TINY, tmp_path, "--set", "pipeline_model_parallel_layout=Et|tL")
    assert advice["before"]["label"] == "most even split"
    assert "note: the config's split does not load (the pipeline layout has 2 stages" in text
    assert advice["changes"] == {"pipeline_model_parallel_layout": advice["after"]["layout"]}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "missing.yaml"], "missing.yaml: cannot read the config"),
        (["--config", str(TINY), "--set", "hidden_size=abc"], "error: --set hidden_size=abc: "),
        (["--config", str(TINY), "--set", "hidden_size=abc"], "hidden_size: expected an integer"),
        (["--config", str(TINY), "--microbatches", "3"], "got 3: change --microbatches"),
        (["--config", str(TINY), "--set", "moe_layer_freq=[0]*2"], "must list num_layers = 6"),
        (["--config", str(TINY), "--set", "world_size=3"], "--set world_size=3: world_size: 3"),
        (["--config", str(TINY), "--grid"], "--grid does not apply with --config"),
        (["--config", str(TINY), "--pp", "4"], "--pp does not apply with --config (the advisor "),
        (["--config", str(TINY), "--pp", "4"], "or set --set pipeline_model_parallel_size=4"),
        (["--config", str(TINY), "--schedule", "all"], "--schedule all does not apply"),
        (["--config", str(TINY), "--schedule", "interleaved-1f1b"], "interleaved-1f1b reads"),
        (["--config", str(TINY), "--memory-cap", "0"], "--memory-cap must be a finite number > 0"),
        (["--config", str(TINY), "--memory-cap", "1e-9"], "no split found fits the memory cap"),
        (["--set", "num_layers=4"], "--set and --memory-cap apply to the advisor: add --config"),
    ],
)
def test_bad_input_is_one_sentence(
    args: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-dualpipe: error: ") and message in err
    assert "\n" not in err
