"""The launcher of ``train``: the embedded CPU launcher's handling of a failing rank (its
error comes back, the others are killed). Which environment makes this process a rank:
tests/test_rank_env.py."""

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


def _fail_on_rank_1(cfg: object) -> None:
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("boom on purpose")
    time.sleep(600)  # a straggler: must be killed, not waited for


@pytest.mark.slow
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
