"""Generators follow their algorithms: DualPipe and DualPipeV match reference orders, and bad
parameters are refused with one sentence saying what to change."""

import pytest
import torch

from megatron_dualpipe.schedules.ir import Action, Kind, ScheduleError
from megatron_dualpipe.schedules.registry import generate


def _our_order(name: str, ranks: int, microbatches: int, rank: int) -> list[str]:
    return [str(a) for a in generate(name, ranks, microbatches).ranks[rank]]


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (4, 8), (4, 10), (8, 16), (8, 23)])
def test_dualpipev_matches_torch_pipelining(ranks: int, microbatches: int) -> None:
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    from megatron_dualpipe.planner.torch_schedules import from_torch_pipelining

    ours = generate("dualpipev", ranks, microbatches)
    theirs = from_torch_pipelining(
        pipelining.ScheduleDualPipeV, ranks, microbatches, ours.placement, "torch-dualpipev"
    )
    for rank in range(ranks):
        assert ours.ranks[rank] == theirs.ranks[rank], f"rank {rank}"


class _Recorder:
    """Stands in for DeepSeek's DualPipe engine: records what its step() issues instead of
    computing, so we can compare compute orders without CUDA."""

    def __init__(self, engine_cls, ranks: int, rank: int):
        self.engine = object.__new__(engine_cls)
        e = self.engine
        e.rank, e.num_ranks = rank, ranks
        e.is_first_rank, e.is_last_rank = rank == 0, rank == ranks - 1
        e.is_middle_rank = rank in (ranks // 2 - 1, ranks // 2)
        e.is_in_second_half = rank >= ranks // 2
        e.batch_dim = 0
        e.loss_chunks = [torch.zeros(())]  # what step() stacks into its returned loss
        self.tokens: list[str] = []
        self.counts = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
        self.deferred: list[str] = []
        for name in (
            "_recv_forward",
            "_send_forward",
            "_recv_backward",
            "_send_backward",
            "_commit_and_wait_comm",
            "_reset_states",
        ):
            setattr(e, name, lambda *a, **k: None)
        e._forward_chunk = lambda phase, recv=True, send=True: self.tokens.append(self._f(phase))
        e._backward_chunk = lambda phase, enable_zb=False, recv=True, send=True: self.tokens.append(
            self._b(phase, enable_zb)
        )
        e._forward_backward_chunk = lambda p0, p1, recv0=True: self.tokens.append(
            f"({self._f(p0)};{self._b(p1, False)})FB"
        )
        e._weight_chunk = lambda: self.tokens.append(self.deferred.pop(0))

    def _unit(self, kind: str, phase: int) -> tuple[int, int]:
        e = self.engine
        direction = phase ^ e.is_in_second_half
        half = self.microbatches // 2
        mb = self.counts[(kind, direction)] + (half if direction else 0)
        self.counts[(kind, direction)] += 1
        stage = e.rank if direction == 0 else 2 * e.num_ranks - 1 - e.rank
        return stage, mb

    def _f(self, phase: int) -> str:
        stage, mb = self._unit("F", phase)
        return f"{stage}F{mb}"

    def _b(self, phase: int, zero_bubble: bool) -> str:
        stage, mb = self._unit("B", phase)
        if zero_bubble:
            self.deferred.append(f"{stage}W{mb}")
            return f"{stage}B{mb}"
        return f"{stage}BW{mb}"

    def run(self, microbatches: int) -> list[str]:
        self.microbatches = microbatches
        engine_cls = type(self.engine)
        engine_cls.step(self.engine, num_chunks=microbatches, criterion=lambda *a: None)
        assert not self.deferred
        return self.tokens


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (4, 8), (4, 12), (8, 16), (8, 20)])
def test_dualpipe_matches_deepseek_reference(ranks: int, microbatches: int) -> None:
    reference = pytest.importorskip("dualpipe")
    comm = pytest.importorskip("dualpipe.comm")
    comm.TENSOR_SHAPES, comm.TENSOR_DTYPE = [(1,)], torch.float32
    for rank in range(ranks):
        recorded = _Recorder(reference.DualPipe, ranks, rank).run(microbatches)
        assert _our_order("dualpipe", ranks, microbatches, rank) == recorded, f"rank {rank}"


@pytest.mark.parametrize(
    ("name", "ranks", "microbatches", "message"),
    [
        ("dualpipe", 3, 12, "even number of pipeline ranks"),
        ("dualpipe", 4, 9, "micro-batches to be >= 2 x PP = 8 and even"),
        ("dualpipe", 4, 6, "micro-batches to be >= 2 x PP = 8 and even"),
        ("dualpipev", 4, 7, "micro-batches to be >= 2 x PP = 8, got 7"),
        ("dualpipev", 1, 8, "at least 2 pipeline ranks"),
        ("interleaved-1f1b", 4, 6, "micro-batches to be a multiple of PP = 4, got 6"),
        ("1f1b", 4, 0, "at least one micro-batch"),
        ("nope", 4, 8, "unknown pipeline schedule .nope."),
    ],
)
def test_bad_parameters_are_refused_clearly(
    name: str, ranks: int, microbatches: int, message: str
) -> None:
    with pytest.raises(ScheduleError, match=message):
        generate(name, ranks, microbatches)


def test_zb1p_defers_w_by_rank_index() -> None:
    schedule = generate("zb1p", 4, 8)
    last = schedule.ranks[3]
    # The last rank holds back three W: its first W comes after its fourth B.
    first_w = next(i for i, a in enumerate(last) if a.kind is Kind.W)
    assert [a for a in last[:first_w] if a.kind is Kind.B] == [
        Action(Kind.B, 3, m) for m in range(4)
    ]
    assert schedule.ranks[0][:4] == [Action(Kind.F, 0, m) for m in range(4)]
