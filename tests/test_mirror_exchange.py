"""The mirror exchange's waits, recorded: one process on torch's fake process-group backend
(rank 0 of 4, whose mirror rank is 3), every batch handed to a recording stand-in for
``batch_isend_irecv`` whose works record each ``wait`` call and its arguments.

- no wait has a host timeout (``wait()`` only; on NCCL that makes the current stream
  wait, and the host runs on), and at most two exchanges are issued and not yet waited
  (two are, so the exchange does overlap);
- every operation goes to the pipeline group, to the mirror rank (no group is made);
- a stuck exchange becomes a ``PipelineWaitError`` naming both ranks, from the hang monitor;
- the layout travels on the gradients' device (NCCL serves CUDA tensors only: ``meta``
  stands for the GPU here);
- on gloo, two ranks holding different numbers of process groups still meet;
- on gloo, a rank's two chunks are two different model stages, with different numbers of
  buckets (stage r and R-1-r of a real model never have the same): every copy's
  gradients are summed (this raised ValueError from ``zip(..., strict=True)``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_dualpipe.runtime import PipelineWaitError
from megatron_dualpipe.runtime import mirror as mirror_module
from megatron_dualpipe.runtime.mirror import IN_FLIGHT, MirrorPair, param_buckets, param_grad
from megatron_dualpipe.schedules.ir import Placement
from tests.multiproc import run_workers

WORLD = 4
PLACEMENT = Placement("mirror", WORLD, 2 * WORLD, 2)


@dataclass
class _Log:
    """What the exchange asked of the backend."""

    batches: list[list[dist.P2POp]] = field(default_factory=list)
    waits: list[tuple[tuple, dict]] = field(default_factory=list)
    outstanding: int = 0  # issued, not yet waited
    peak: int = 0
    stuck_after: int | None = None  # the batch from which works never complete


class _Work:
    """A coalesced batch's one work: complete once waited on, unless stuck."""

    def __init__(self, log: _Log, stuck: bool):
        self.log, self.stuck, self.done = log, stuck, False

    def wait(self, *args, **kwargs) -> bool:
        self.log.waits.append((args, kwargs))
        if self.stuck:  # as an aborted communicator ends a pending operation
            time.sleep(1.0)
            raise RuntimeError("the communicator was aborted")
        if not self.done:
            self.done = True
            self.log.outstanding -= 1
        return True

    def is_completed(self) -> bool:
        return self.done


@contextmanager
def _recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Log]:
    """Rank 0 of a fake world of 4, its batches recorded (the group creations run)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    log = _Log()

    def batch(ops: list[dist.P2POp]) -> list[_Work]:
        log.batches.append(ops)
        log.outstanding += 1
        log.peak = max(log.peak, log.outstanding)
        stuck = log.stuck_after is not None and len(log.batches) > log.stuck_after
        return [_Work(log, stuck)]

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(dist, "batch_isend_irecv", batch)
            yield log
    finally:
        dist.destroy_process_group()


def _chunks(device: str = "cpu") -> list[nn.Module]:
    return [nn.Sequential(*(nn.Linear(8, 8, device=device) for _ in range(3))) for _ in range(2)]


#: Bytes per bucket: each 8 x 8 weight (256 bytes) one bucket, each bias (32) another.
BUCKET = 256


def _sync(pair: MirrorPair, chunks: list[nn.Module], *, check_layout: bool = False) -> None:
    pair.sync_grads(
        chunks,
        buckets=lambda m: param_buckets(m, param_grad, bucket_bytes=BUCKET),
        check_layout=check_layout,
    )


def test_the_mirror_exchange_never_waits_with_a_timeout_and_keeps_two_in_flight(
    monkeypatch,
) -> None:
    created = []
    new_group = dist.new_group

    def recorded_new_group(ranks=None, **kwargs):
        created.append((list(ranks), kwargs.get("use_local_synchronization")))
        return new_group(ranks, **kwargs)

    monkeypatch.setattr(dist, "new_group", recorded_new_group)
    with _recorded(monkeypatch) as log:
        pair = MirrorPair(PLACEMENT, 0, timeout_s=5.0)
        chunks = _chunks()
        _sync(pair, chunks)
        buckets = len(param_buckets(chunks[0], param_grad, bucket_bytes=BUCKET))
        groups = {id(op.group): op.group for ops in log.batches for op in ops}
        pair_ranks = [dist.get_process_group_ranks(g) for g in groups.values()]
        peers = {dist.get_global_rank(op.group, op.group_peer) for b in log.batches for op in b}
    assert buckets == 6
    assert len(log.batches) == 2 * buckets  # a batch per bucket, each way
    assert [len(ops) for ops in log.batches] == [2] * (2 * buckets)  # a send and a receive
    assert log.waits == [((), {})] * (2 * buckets)  # every wait without a timeout
    assert log.peak == IN_FLIGHT == 2
    assert log.outstanding == 0
    # No group made: the exchange runs on the pipeline group.
    assert created == []
    assert pair_ranks == [[0, 1, 2, 3]] and peers == {3}


@pytest.mark.slow
def test_a_stuck_mirror_exchange_is_named_by_the_hang_monitor(monkeypatch) -> None:
    with _recorded(monkeypatch) as log:
        pair = MirrorPair(PLACEMENT, 0, timeout_s=0.2)
        log.stuck_after = 3  # the fourth batch never completes
        start = time.monotonic()
        with pytest.raises(PipelineWaitError) as raised:
            _sync(pair, _chunks())
        elapsed = time.monotonic() - start
    message = str(raised.value)
    assert message.startswith(
        "pipeline rank 0 gave up on the mirror copy's gradients (peer: rank 3) after "
    )
    assert "seen by the rank's hang monitor" in message
    assert elapsed < 30.0  # the monitor named it: no hang (its timeout is 0.2 s)
    assert len(log.batches) == 5  # the fourth's wait came after the fifth's issue


def test_the_mirror_layout_travels_on_the_gradients_device(monkeypatch) -> None:
    """NCCL serves CUDA tensors only: the layout check must not send CPU tensors (here
    ``meta`` stands for the GPU; the exchange itself is recorded, not run)."""
    devices = []

    def swap(self, values, device):
        devices.append(device)
        return mirror_module._encode(mirror_module._decode(values)[::-1])

    with _recorded(monkeypatch):
        monkeypatch.setattr(MirrorPair, "swap_ints", swap)
        pair = MirrorPair(PLACEMENT, 0)
        chunks = _chunks("meta")
        pair.sync_grads(chunks)
        pair.copy_params(chunks)
    assert devices == [torch.device("meta")] * 2


def _pair_after_uneven_groups(rank: int, world: int) -> list[float]:
    """Rank 0 holds one group more than its mirror rank 1 (as Megatron's first pipeline
    rank holds the position-embedding group alone), then both make their pair and sum."""
    dist.new_group([0])  # every rank calls; only rank 0 is a member
    return _summed_by_a_pair(rank, world)


def _summed_by_a_pair(rank: int, world: int) -> list[float]:
    """A new pair sums two one-layer chunks whose gradients are 10 rank + chunk; the
    first weight gradient of each chunk after the sum."""
    pair = MirrorPair(Placement("mirror", world, 2 * world, 2), rank, timeout_s=10.0)
    chunks = [nn.Linear(2, 2) for _ in range(2)]
    for chunk, module in enumerate(chunks):
        for p in module.parameters():
            p.grad = torch.full_like(p, float(10 * rank + chunk))
    pair.sync_grads(chunks)
    pair.close()
    return [m.weight.grad[0, 0].item() for m in chunks]


@pytest.mark.multiproc
def test_a_pair_whose_ranks_hold_different_numbers_of_groups_still_meets() -> None:
    """Ranks holding different numbers of groups (torch names a locally synchronised
    group after them: a pair group made so would hang here) still exchange."""
    # Chunk 0 of rank r pairs with chunk 1 of rank 1 - r: 10 r + 0 + 10 (1 - r) + 1 = 11.
    assert run_workers(_pair_after_uneven_groups, 2, timeout_s=30) == [[11.0, 11.0]] * 2


def _pairs_made_and_destroyed(rank: int, world: int) -> list[float]:
    """Three pairs one after the other, every group but the default destroyed after each
    (a process that trains several times, as Megatron-LM's pretrain() run again does)."""
    from torch.distributed import distributed_c10d

    sums = []
    for _ in range(3):
        sums.append(_summed_by_a_pair(rank, world)[0])
        default = distributed_c10d._get_default_group()
        for group in list(distributed_c10d._world.pg_map):
            if group is not default:
                dist.destroy_process_group(group)
    return sums


@pytest.mark.multiproc
def test_pairs_made_again_after_the_groups_were_destroyed_still_meet() -> None:
    """A locally synchronised pair group's name recurs after groups are destroyed, and its
    ranks then read the earlier group's addresses from the store (this hung until the
    workers were killed)."""
    assert run_workers(_pairs_made_and_destroyed, 2, timeout_s=30) == [[11.0] * 3] * 2


def _unequal_stages_summed(rank: int, world: int) -> dict:
    """Stage 0 is two layers, stage 1 one: rank r's chunk 0 (stage r) and chunk 1 (stage
    1 - r) fill different numbers of buckets. Gradients are 10 rank + chunk; returns each
    chunk's bucket count and the distinct gradient values after the sum."""
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8))]
    chunks = [stages[rank], stages[1 - rank]]
    for chunk, module in enumerate(chunks):
        for p in module.parameters():
            p.grad = torch.full_like(p, float(10 * rank + chunk))
    pair = MirrorPair(Placement("mirror", world, 2 * world, 2), rank, timeout_s=10.0)
    try:
        _sync(pair, chunks, check_layout=True)
    finally:
        pair.close()
    return {
        "buckets": [len(param_buckets(c, param_grad, bucket_bytes=BUCKET)) for c in chunks],
        "values": sorted(
            {v for c in chunks for p in c.parameters() for v in p.grad.flatten().tolist()}
        ),
    }


@pytest.mark.multiproc
def test_two_stages_of_different_bucket_counts_are_summed() -> None:
    results = run_workers(_unequal_stages_summed, 2, timeout_s=30)
    assert [r["buckets"] for r in results] == [[4, 2], [2, 4]]
    # Each stage's two copies: 10 r + 0 (chunk 0 of rank r) + 10 (1 - r) + 1 = 11.
    assert [r["values"] for r in results] == [[11.0], [11.0]]
