"""NCCL memory per communicator: the estimate from NCCL's buffer rules, against figures
worked out by hand here, and its table in ``simulate --config``."""

from __future__ import annotations

import re

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.planner.nccl_memory import NcclBuffers, nccl_memory
from megatron_dualpipe.schedules.ir import ScheduleError
from megatron_dualpipe.schedules.registry import generate

MIB = 2**20
# By hand, NCCL's defaults: a receive connection holds Simple 4 MiB + LL 8*512*8*16 B
# (0.5 MiB) + LL128 120*640*8*8 B (4,915,200 B) = 9,633,792 B, rounded up to the 2 MiB
# granularity: 5 x 2 MiB = 10 MiB. A send connection: its control block, one 2 MiB unit.
# A peer connected both ways on 2 channels: 2 x (10 + 2) MiB = 24 MiB.
PEER = 24 * MIB


def _table(schedule: str, pp: int, mb: int, buffers: NcclBuffers | None = None) -> dict:
    ranks = nccl_memory(generate(schedule, pp, mb), buffers)
    return {(c.rank, c.comm): (c.peers, c.bytes) for comms in ranks for c in comms}


def test_dualpipe_pp4_pipeline_and_mirror_partners() -> None:
    """The mirror sum runs on the pipeline communicator: a partner that is already a
    neighbour (ranks 1 and 2) costs nothing more; ranks 0 and 3 connect to each other."""
    assert _table("dualpipe", 4, 8) == {
        (0, "pipeline"): ((1,), PEER),
        (0, "mirror"): ((3,), PEER),
        (1, "pipeline"): ((0, 2), 2 * PEER),
        (2, "pipeline"): ((1, 3), 2 * PEER),
        (3, "pipeline"): ((2,), PEER),
        (3, "mirror"): ((0,), PEER),
    }


def test_dualpipev_and_interleaved_peers_follow_the_placement() -> None:
    # The V: rank 0 holds the first and the last stage, so it only talks to rank 1.
    assert _table("dualpipev", 4, 8) == {
        (0, "pipeline"): ((1,), PEER),
        (1, "pipeline"): ((0, 2), 2 * PEER),
        (2, "pipeline"): ((1, 3), 2 * PEER),
        (3, "pipeline"): ((2,), PEER),
    }
    # Interleaved: the loop wraps from rank 3 back to rank 0; no mirror pairs.
    table = _table("interleaved-1f1b", 4, 8)
    assert table[(0, "pipeline")] == ((1, 3), 2 * PEER)
    assert not any(comm == "mirror" for _, comm in table)


def test_environment_changes_the_rules() -> None:
    env = {
        "NCCL_BUFFSIZE": str(MIB),
        "NCCL_NCHANNELS_PER_NET_PEER": "3",
        "NCCL_RUNTIME_CONNECT": "0",
    }
    rules = NcclBuffers.from_env(env)
    # 1 MiB + 0.5 MiB + 4,915,200 B = 6,488,064 B -> 4 x 2 MiB; 3 channels -> 4 (a power of 2).
    assert (rules.receive_bytes, rules.channels_per_peer) == (8 * MIB, 4)
    assert not rules.runtime_connect
    assert rules.peer_bytes(1) == 4 * (8 + 2) * MIB
    assert "not counted" in rules.describe()
    capped = NcclBuffers.from_env({**env, "NCCL_MAX_P2P_NCHANNELS": "1"})
    assert capped.channels_per_peer == 1
    assert NcclBuffers.from_env({}) == NcclBuffers()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NCCL_BUFFSIZE": "4M"}, "NCCL_BUFFSIZE='4M' is not a whole number"),
        ({"NCCL_MAX_P2P_NCHANNELS": "0"}, "NCCL_MAX_P2P_NCHANNELS='0' is out of range"),
    ],
)
def test_bad_environment_is_one_sentence(env: dict, message: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(message)):
        NcclBuffers.from_env(env)


def test_simulate_config_prints_the_estimate(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("NCCL_BUFFSIZE", "NCCL_NCHANNELS_PER_NET_PEER", "NCCL_MAX_P2P_NCHANNELS"):
        monkeypatch.delenv(name, raising=False)
    sets = ["pipeline_schedule=dualpipe", "pipeline_model_parallel_size=4", "world_size=4"]
    args = [arg for value in sets for arg in ("--set", value)]
    assert main(["simulate", "--config", "configs/tiny_gpt_cpu.yaml", *args]) == 0
    out = capsys.readouterr().out
    assert "NCCL memory per rank under dualpipe, an estimate from NCCL's buffer rules" in out
    table = out.split("NCCL memory per rank")[1].splitlines()[3:9]
    rows = [re.split(r"\s{2,}", line.strip()) for line in table]
    got = {(int(r), comm): (peers, int(mib)) for r, comm, _, peers, mib in rows}
    assert got[(1, "pipeline")] == ("0, 2", 2 * PEER // MIB)
    assert got[(0, "mirror")] == ("3", PEER // MIB)
    assert len(got) == 6
    assert f"most (estimate): {2 * PEER // MIB} MiB on rank 0" in out
