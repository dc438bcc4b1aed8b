"""Which environment makes this process a rank (torchrun's or srun's variables), and each
malformed variable as one sentence before any process-group work."""

from __future__ import annotations

import pytest

from megatron_dualpipe.runtime.rank_env import LauncherEnvError, RankEnv, launcher_env

_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
         "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in _KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_no_launcher(clean_env: pytest.MonkeyPatch) -> None:
    assert launcher_env() is None


def test_torchrun_environment(clean_env: pytest.MonkeyPatch) -> None:
    for key, value in dict(
        RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", MASTER_ADDR="node0", MASTER_PORT="6000"
    ).items():
        clean_env.setenv(key, value)
    assert launcher_env() == RankEnv(3, 8, 1, "node0", 6000, "torchrun")


def test_srun_environment_as_torchrun_would_set_it(clean_env: pytest.MonkeyPatch) -> None:
    for key, value in dict(
        SLURM_PROCID="5", SLURM_NTASKS="16", SLURM_LOCALID="5", MASTER_ADDR="n1", MASTER_PORT="7"
    ).items():
        clean_env.setenv(key, value)
    env = launcher_env()
    assert env == RankEnv(5, 16, 5, "n1", 7, "srun")
    assert env.torchrun_variables() == {
        "RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "MASTER_ADDR": "n1", "MASTER_PORT": "7"
    }  # fmt: skip
    clean_env.delenv("MASTER_ADDR")
    with pytest.raises(LauncherEnvError, match="srun environment without MASTER_ADDR"):
        launcher_env()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            dict(RANK="zero", WORLD_SIZE="2"),
            "torchrun environment with RANK='zero': expected a whole number (unset RANK and "
            "WORLD_SIZE, or SLURM_PROCID and SLURM_NTASKS, to let train fork the ranks itself)",
        ),
        (
            dict(SLURM_PROCID="4", SLURM_NTASKS="4"),
            "srun environment with SLURM_PROCID=4 and SLURM_NTASKS=4: the rank must be between "
            "0 and SLURM_NTASKS - 1",
        ),
        (
            dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="n1", MASTER_PORT="http"),
            "torchrun environment with MASTER_PORT='http': expected a whole number (unset RANK "
            "and WORLD_SIZE, or SLURM_PROCID and SLURM_NTASKS, to let train fork the ranks itself)",
        ),
    ],
)
def test_a_malformed_launcher_variable_is_one_sentence(monkeypatch, env, message) -> None:
    for key in _KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LauncherEnvError) as info:
        launcher_env()
    assert str(info.value) == message
