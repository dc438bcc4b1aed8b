"""Setting up the pipeline's communicator at scale, on torch's fake process-group backend.

- At world 2,048 with PP=16 (128 pipelines, Megatron's layout: pipeline ``i`` holds ranks
  ``i, i + 128, ...``), every rank takes part in one group creation, of its own pipeline,
  with local synchronisation (only its members join), and in no collective of the world;
  every group is made by exactly its members. The design before (every rank made every
  pipeline's two-rank channel groups, each ``new_group`` a call of the whole world, after
  gathering every rank's pipeline) had each rank join 7,680 creations, 8 of them its
  own, and one gather over the world. Run with ``-s`` to see the set-up times.
- Where the default group is bound to a device, the group is split from the pipeline
  group instead (torch would otherwise split the world's communicator, every rank of the
  world taking part); the call is recorded, not run (it needs NCCL).
- On NCCL the group asks for a high-priority stream (``ProcessGroupNCCL.Options(
  is_high_priority_stream=True)``), elsewhere for the backend's defaults: checked on the
  options passed, with a stand-in for the CUDA-only options class.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_dualpipe.runtime.transport import make_pipeline_group, pipeline_group_options
from megatron_dualpipe.schedules.comm_plan import channels
from megatron_dualpipe.schedules.registry import generate

WORLD, PP = 2048, 16
PIPELINES = WORLD // PP
#: Collectives of a group a rank may be asked to join while groups are made.
COLLECTIVES = ("all_gather_object", "all_gather", "barrier", "broadcast", "all_reduce")


def _pipeline(rank: int) -> list[int]:
    """Megatron's pipeline of ``rank``: every PIPELINES-th rank from its first."""
    return list(range(rank % PIPELINES, WORLD, PIPELINES))


class _Calls:
    """What one rank is asked to join: each group creation (its ranks and options) and
    each collective over the world."""

    def __init__(self) -> None:
        self.created: list[tuple[tuple[int, ...], dict]] = []
        self.collectives: list[str] = []


@contextmanager
def _fake_rank(rank: int):
    """This process as ``rank`` of a fake world of WORLD ranks; yields its pipeline group
    (made as Megatron makes it: not counted)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        yield dist.new_group(_pipeline(rank), use_local_synchronization=True)
    finally:
        dist.destroy_process_group()


def _count(patch: pytest.MonkeyPatch, calls: _Calls) -> None:
    """Count every group creation and world collective into ``calls`` (passing them on;
    the fake backend's gather answers as a real one would)."""
    new_group, split_group = dist.new_group, dist.split_group

    def counted_new_group(ranks=None, **kwargs):
        calls.created.append((tuple(ranks), kwargs))
        return new_group(ranks, **kwargs)

    def counted_split_group(parent_pg=None, split_ranks=None, **kwargs):
        global_ranks = dist.get_process_group_ranks(parent_pg)
        for split in split_ranks:
            calls.created.append((tuple(global_ranks[i] for i in split), kwargs))
        return split_group(parent_pg, split_ranks, **kwargs)

    def counted(name: str, collective: Callable) -> Callable:
        def run(*args, **kwargs):
            calls.collectives.append(name)
            if name != "all_gather_object":
                return collective(*args, **kwargs)
            every = args[0]  # the fake backend would gather only this rank's object
            for r in range(WORLD):
                every[r] = tuple(_pipeline(r))
            return None

        return run

    patch.setattr(dist, "new_group", counted_new_group)
    patch.setattr(dist, "split_group", counted_split_group)
    for name in COLLECTIVES:
        patch.setattr(dist, name, counted(name, getattr(dist, name)))


def _before(pipeline: dist.ProcessGroup) -> None:
    """The design before: gather every rank's pipeline over the world, then make every
    pipeline's two-rank channel groups, each a call of the whole world."""
    mine = tuple(dist.get_process_group_ranks(pipeline))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    placement = generate("dualpipe", PP, 2 * PP).placement
    for members, comm in itertools.product(sorted(set(every)), channels(placement)):
        dist.new_group([members[r] for r in comm.ranks])


def _set_up(rank: int, monkeypatch, make: Callable) -> tuple[_Calls, float]:
    calls = _Calls()
    with _fake_rank(rank) as pipeline, monkeypatch.context() as patch:
        _count(patch, calls)
        start = time.perf_counter()
        made = make(pipeline)
        seconds = time.perf_counter() - start
        if made is not None:
            assert dist.get_process_group_ranks(made) == _pipeline(rank)
    return calls, seconds


def test_each_rank_joins_only_the_creation_of_its_own_pipelines_group(monkeypatch) -> None:
    creators: dict[tuple[int, ...], set[int]] = {}
    times = []
    for rank in range(WORLD):
        calls, seconds = _set_up(rank, monkeypatch, make_pipeline_group)
        times.append(seconds)
        assert calls.collectives == [], f"rank {rank} joined {calls.collectives}"
        [(members, options)] = calls.created  # one creation, its own
        assert members == tuple(_pipeline(rank))
        assert options["use_local_synchronization"] is True
        creators.setdefault(members, set()).add(rank)
    assert all(set(members) == made_by for members, made_by in creators.items())
    assert len(creators) == PIPELINES
    sample = [0, 1, PIPELINES, WORLD - 1]
    before = [_set_up(rank, monkeypatch, _before) for rank in sample]
    for rank, (calls, _) in zip(sample, before, strict=True):
        own = [m for m, _ in calls.created if rank in m]
        assert len(calls.created) == PIPELINES * 60 == 7680 and len(own) in (4, 8), rank
        assert calls.collectives == ["all_gather_object"]
    print(
        f"\nworld {WORLD}, PP {PP}: before, {len(before[0][0].created)} group creations per "
        f"rank, {max(s for _, s in before) * 1e3:.0f} ms at most; after, 1 per rank, "
        f"{max(times) * 1e3:.2f} ms at most (median {sorted(times)[WORLD // 2] * 1e3:.2f} ms)"
    )


class _Options:
    """Stands in for ``ProcessGroupNCCL.Options`` (CUDA builds only)."""

    def __init__(self, is_high_priority_stream: bool = False):
        self.is_high_priority_stream = is_high_priority_stream


class _StandInNccl:
    Options = _Options


def test_an_nccl_pipeline_group_asks_for_a_high_priority_stream(monkeypatch) -> None:
    assert pipeline_group_options("gloo") is None
    assert pipeline_group_options("fake") is None
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _StandInNccl, raising=False)
    assert pipeline_group_options("nccl").is_high_priority_stream is True
    seen = []
    with _fake_rank(5) as pipeline, monkeypatch.context() as patch:
        patch.setattr(dist, "get_backend", lambda group=None: "nccl")
        patch.setattr(dist, "new_group", lambda ranks, **kw: seen.append(("new", kw)))
        patch.setattr(
            dist,
            "split_group",
            lambda parent, splits, **kw: seen.append(("split", parent, splits, kw)),
        )
        make_pipeline_group(pipeline)
        world = dist.group.WORLD
        world.bound_device_id = torch.device("cuda", 0)  # as init_process_group(device_id=)
        try:
            make_pipeline_group(pipeline)
        finally:
            world.bound_device_id = None
    (new, options), (split, parent, splits, split_options) = seen
    assert new == "new" and options["use_local_synchronization"] is True
    assert options["pg_options"].is_high_priority_stream is True
    assert split == "split" and parent is pipeline and splits == [list(range(PP))]
    assert split_options["pg_options"].is_high_priority_stream is True
