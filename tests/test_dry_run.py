"""``train --dry-run``: every pipeline rank built at full size on the meta device in a fake
world (megatron_dualpipe/megatron/training/dry_run.py).

- The tiny configs' dry run builds, chunk by chunk, the parameters (counts by dtype,
  expert parameters) that ``train`` builds for real on forked gloo ranks with
  ``build_model`` (DDP, initialised weights), and counts the model's parameters once as
  the real ranks' union of global names does (at TP=2: as the same model at TP=1); the
  memory model agrees exactly with every built rank.
- DeepSeek-V3 (configs/deepseek_v3_pp16.yaml, world 2,048) under dualpipe and dualpipev
  (slow): every rank agrees with the memory model, the model without its MTP block is
  DeepSeek's published 671B, every rank joins the same group creations of the world
  (9,859 on megatron-core 0.16, 13,957 on 0.19).
- Bad ``--ranks`` and ``--ranks`` without ``--dry-run`` are refused in one sentence.
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter
from pathlib import Path

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.errors import DualPipeError
from megatron_dualpipe.megatron.compat.version import installed_megatron_core
from megatron_dualpipe.megatron.training import load_config
from tests.multiproc import run_workers, slow_unless

pytestmark = pytest.mark.megatron

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
#: Group creations of the whole world each DeepSeek-V3 rank takes part in, by release
#: (Megatron's initialize_model_parallel makes more groups from 0.19 on).
WORLD_CREATIONS = {"0.16": 9_859, "0.19": 13_957}
#: (config, overrides): what the tiny configs build under our placements and Megatron's.
TINY = {
    "gpt-dualpipev": ("tiny_gpt_cpu.yaml", []),
    "gpt-dualpipe": ("tiny_gpt_cpu.yaml", ["pipeline_schedule=dualpipe"]),
    "gpt-1f1b-tp2": (
        "tiny_gpt_cpu.yaml",
        ["pipeline_schedule=1f1b", "world_size=4", "tensor_model_parallel_size=2"],
    ),
    "gpt-interleaved": (
        "tiny_gpt_cpu.yaml",
        ["pipeline_schedule=interleaved-1f1b", "virtual_pipeline_model_parallel_size=2"],
    ),
    "moe-dualpipev": ("tiny_moe_cpu.yaml", []),
    "deepseek-dualpipev": ("tiny_deepseek_cpu.yaml", []),
    "deepseek-dualpipe-layout": (
        "tiny_deepseek_cpu.yaml",
        [
            "pipeline_schedule=dualpipe",
            "decoder_first_pipeline_num_layers=null",
            "decoder_last_pipeline_num_layers=null",
            "pipeline_model_parallel_layout=Ettt|ttttmL",
            "qk_layernorm=true",
        ],
    ),
}


def _config(name: str):
    path, overrides = TINY[name]
    return load_config(CONFIGS / path, overrides)


def _real_build(rank: int, world_size: int, name: str) -> dict:
    """What ``train`` builds on this rank: per chunk its parameter counts by dtype and its
    expert parameters; its parameters' elements by global name."""
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    from megatron_dualpipe.megatron.compat.cpu_compat import apply_cpu_compat
    from megatron_dualpipe.megatron.model.names import global_named_parameters
    from megatron_dualpipe.megatron.training.loop import initialize_parallel_state
    from megatron_dualpipe.megatron.training.model import build_model, transformer_config

    apply_cpu_compat()
    cfg = _config(name)
    initialize_parallel_state(cfg)
    try:
        model = build_model(cfg, transformer_config(cfg, on_gpu=False))
        chunks = []
        for chunk in model:
            params = list(unwrap_model(chunk).parameters())
            by_dtype = Counter()
            for p in params:
                by_dtype[str(p.dtype).removeprefix("torch.")] += p.numel()
            expert = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
            chunks.append((dict(by_dtype), expert))
        named = {n: p.numel() for chunk in model for n, p in global_named_parameters(chunk).items()}
        return {
            "at_origin": parallel_state.get_data_parallel_rank() == 0
            and parallel_state.get_expert_model_parallel_rank() == 0
            and parallel_state.get_tensor_model_parallel_rank() == 0,
            "pipeline_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "chunks": chunks,
            "named": named,
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.multiproc
@pytest.mark.parametrize("name", slow_unless(lambda n: n == "deepseek-dualpipev", list(TINY)))
def test_the_dry_run_builds_what_train_builds(name: str) -> None:
    from megatron_dualpipe.megatron.training.dry_run import dry_run
    from megatron_dualpipe.planner.dry_run_report import agrees, memory_of_ranks

    cfg = _config(name)
    real = run_workers(_real_build, cfg.launch_world_size, args=(name,), timeout_s=240)
    result = dry_run(cfg, source=name)
    memory = memory_of_ranks(result.values, [])
    origin = {r["pipeline_rank"]: r["chunks"] for r in real if r["at_origin"]}
    assert sorted(origin) == [r.pipeline_rank for r in result.ranks]
    for report in result.ranks:
        built = [
            ({k: n for k, (n, _) in c.by_dtype.items()}, c.expert_params) for c in report.chunks
        ]
        assert built == [(dict(d), e) for d, e in origin[report.pipeline_rank]]
        # The memory model leaves interleaved-1f1b out (stages per rank set by the config).
        expected = None if cfg.virtual_pipeline_model_parallel_size else True
        assert agrees(report, memory) is expected, f"pipeline rank {report.pipeline_rank}"
    if cfg.tensor_model_parallel_size == 1:  # the ranks' union of global names: each once
        union: dict = {}
        for r in real:
            union.update(r["named"])
        assert result.unique_params == sum(union.values())
        mtp = sum(n for key, n in union.items() if key.startswith("mtp."))
        assert result.unique_mtp_params == mtp
    else:  # the same model as one tensor-parallel rank holds it
        whole = dry_run(load_config(CONFIGS / TINY[name][0], ["pipeline_schedule=1f1b"]))
        assert (result.unique_params, result.unique_mtp_params) == (
            whole.unique_params,
            whole.unique_mtp_params,
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "pipeline_schedule=dualpipev",
            "decoder_first_pipeline_num_layers=null",
            "decoder_last_pipeline_num_layers=null",
            "pipeline_model_parallel_layout=Et|(tt|)*30,mL",
        ],
    ],
    ids=["dualpipe", "dualpipev"],
)
def test_deepseek_v3_at_full_size(overrides: list[str]) -> None:
    from megatron_dualpipe.megatron.training.dry_run import dry_run
    from megatron_dualpipe.planner.dry_run_report import agrees, dry_run_lines, memory_of_ranks

    cfg = load_config(CONFIGS / "deepseek_v3_pp16.yaml", overrides)
    result = dry_run(cfg, source="deepseek_v3_pp16.yaml")
    memory = memory_of_ranks(result.values, [])
    assert [r.pipeline_rank for r in result.ranks] == list(range(16))
    assert all(agrees(r, memory) for r in result.ranks)
    # DeepSeek-V3: 671B parameters without the MTP module (the published size).
    assert result.unique_params - result.unique_mtp_params == 671_026_404_352
    assert result.unique_mtp_params == 11_610_067_968
    creations = {r.world_creations for r in result.ranks}
    minor = ".".join(installed_megatron_core().split(".")[:2])
    assert len(creations) == 1
    if minor in WORLD_CREATIONS:
        assert creations == {WORLD_CREATIONS[minor]}
    pipeline = "pipeline group (Megatron's; carries the lock-step plan)"
    assert all(pipeline in {g.name for g in r.groups} for r in result.ranks)
    message = 4096 * 1 * 7168 * 2  # bf16 (seq, micro-batch, hidden)
    first = result.ranks[0]
    assert {m.nbytes for m in first.messages} == {message}
    # Rank 0's four message kinds (activation and gradient, in and out) carry each of the
    # 120 micro-batches once under dualpipev; under dualpipe each direction has half.
    per_kind = 120 if overrides else 60
    assert [m.count for m in first.messages] == [per_kind] * 4
    assert all(r.params > 0 and r.seconds < 60 for r in result.ranks)
    assert result.peak_host_bytes < 4 * 2**30
    lines = dry_run_lines(result, memory)
    assert lines[-1].startswith("model parameters, each counted once: 682,636,472,320")


def test_bad_ranks_are_refused_in_one_sentence() -> None:
    from megatron_dualpipe.megatron.model.built import parse_ranks

    assert parse_ranks("3,1,1", 4) == [1, 3]
    assert parse_ranks(None, 2) == [0, 1]
    for text in ("4", "a", "", "-1"):
        with pytest.raises(DualPipeError, match=r"--ranks .*: give pipeline ranks between 0 and 3"):
            parse_ranks(text, 4)


def test_ranks_need_the_dry_run() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", "--config", str(CONFIGS / "tiny_gpt_cpu.yaml"), "--ranks", "0"])
    assert code != 0
    assert "--ranks chooses the ranks of a dry run: add --dry-run" in err.getvalue()
