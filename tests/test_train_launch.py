"""The launcher of ``train``: which environment makes this process a rank, and the embedded
CPU launcher's handling of a failing rank (its error comes back, the others are killed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import launch, load_config

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"
_LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in (*_LAUNCH_KEYS, "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_no_launcher(clean_env: pytest.MonkeyPatch) -> None:
    assert launch.launcher_env() is None


def test_torchrun_environment(clean_env: pytest.MonkeyPatch) -> None:
    for key, value in dict(
        RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", MASTER_ADDR="node0", MASTER_PORT="6000"
    ).items():
        clean_env.setenv(key, value)
    assert launch.launcher_env() == launch.RankEnv(3, 8, 1, "node0", 6000, "torchrun")


def test_srun_environment(clean_env: pytest.MonkeyPatch) -> None:
    for key, value in dict(
        SLURM_PROCID="5", SLURM_NTASKS="16", SLURM_LOCALID="5", MASTER_ADDR="n1", MASTER_PORT="7"
    ).items():
        clean_env.setenv(key, value)
    assert launch.launcher_env() == launch.RankEnv(5, 16, 5, "n1", 7, "srun")
    clean_env.delenv("MASTER_ADDR")
    with pytest.raises(launch.LaunchError, match="srun environment without MASTER_ADDR"):
        launch.launcher_env()


def _fail_on_rank_1(cfg: object) -> None:
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("boom on purpose")
    time.sleep(600)  # a straggler: must be killed, not waited for


def test_a_failing_rank_is_reported_and_the_others_killed(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setattr(launch, "run_rank", _fail_on_rank_1)
    started = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.train(load_config(TINY), source=str(TINY))
    assert time.monotonic() - started < 30
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed: RuntimeError: boom on purpose\n")
    assert "Traceback" in message
