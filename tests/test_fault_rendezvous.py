"""A rendezvous that cannot happen under torchrun's or srun's variables is one sentence
naming the rank, the address and the port (each was a 34-line traceback): the port is
taken, the other ranks never come, rank 0 is out of reach."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from megatron_dualpipe.megatron.training import load_config, train
from megatron_dualpipe.megatron.training.launch import LaunchError
from megatron_dualpipe.runtime.launch import pick_port

pytestmark = pytest.mark.megatron

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"


def _as_rank(monkeypatch, rank: int, port: int) -> None:
    for key in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(key, raising=False)
    env = dict(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))


def _refusal() -> str:
    cfg = load_config(TINY, ["distributed_timeout_minutes=0.05", "output_dir=null"])
    with pytest.raises(LaunchError) as info:
        train(cfg, source=str(TINY))
    return str(info.value)


def test_a_master_port_in_use_is_one_sentence(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _as_rank(monkeypatch, 0, port)
        assert _refusal() == (
            f"rank 0 of 2: MASTER_PORT {port} is already in use on this machine, so the "
            f"rendezvous cannot listen on 127.0.0.1:{port}: choose a free port"
        )


@pytest.mark.slow
def test_peers_that_never_join_are_one_sentence(monkeypatch) -> None:
    port = pick_port()
    _as_rank(monkeypatch, 0, port)
    assert _refusal() == (
        f"rank 0 of 2: only 1 of the 2 ranks joined the rendezvous at 127.0.0.1:{port} before "
        "the timeout: start all 2 ranks with this MASTER_ADDR and MASTER_PORT, or raise "
        "distributed_timeout_minutes"
    )


@pytest.mark.slow
def test_a_rank_0_out_of_reach_is_one_sentence(monkeypatch) -> None:
    port = pick_port()
    _as_rank(monkeypatch, 1, port)
    assert _refusal() == (
        f"rank 1 of 2: could not reach the rendezvous at 127.0.0.1:{port} (rank 0 hosts it) "
        "before the timeout: start rank 0, or check MASTER_ADDR and MASTER_PORT"
    )


@pytest.mark.slow
def test_a_rank_0_out_of_reach_prints_no_cpp_frames(monkeypatch, capfd) -> None:
    """Before its sentence it printed c10d's log of each failed try, each with the c10
    error's 36 lines of C++ frames."""
    _as_rank(monkeypatch, 1, pick_port())
    cfg = load_config(TINY, ["distributed_timeout_minutes=0.02", "output_dir=null"])
    with pytest.raises(LaunchError, match="could not reach the rendezvous at "):
        train(cfg, source=str(TINY))
    err = capfd.readouterr().err
    assert "frame #" not in err and "[c10d]" not in err, err
