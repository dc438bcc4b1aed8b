"""TE's ``_order`` from our schedules (``schedules.cuda_graph_order``) against a model of
Transformer Engine's rules written from ``transformer_engine/pytorch/graph.py``
(``_make_graphed_callables``: the order's dimensions, a chunk's k-th backward on its k-th
forward's graphs, a wgrad entry captured for its chunk's latest backward)."""

from __future__ import annotations

import pytest

from megatron_dualpipe.schedules import check_cuda_graph_order, cuda_graph_order
from megatron_dualpipe.schedules.cuda_graphs import CudaGraphOrderError, max_wgrads_waiting
from megatron_dualpipe.schedules.ir import Kind
from megatron_dualpipe.schedules.registry import SCHEDULES

PPS = range(2, 17)


def _cases() -> list[tuple[str, int, int]]:
    cases = []
    for name, found in SCHEDULES.items():
        for pp in PPS:
            for m in (2 * pp, 3 * pp + (pp % 2)):
                if found.is_legal(pp, m):
                    cases.append((name, pp, m))
    return cases


CASES = _cases()


def _orders(name: str, pp: int, m: int) -> tuple[int, list[list[float]]]:
    schedule = SCHEDULES[name].generate(pp, m)
    chunks = schedule.placement.num_chunks
    return chunks, [cuda_graph_order(schedule, rank) for rank in range(pp)]


def _per_chunk(name: str, pp: int, m: int) -> int:
    """Micro-batches each chunk of a rank sees (dualpipe: each copy takes half)."""
    return m // 2 if SCHEDULES[name].placement == "mirror" else m


def test_every_schedule_and_size_is_covered() -> None:
    assert {name for name, _, _ in CASES} == set(SCHEDULES)
    assert len(CASES) >= 5 * 15


@pytest.mark.parametrize(("name", "pp", "m"), CASES, ids=lambda v: str(v))
def test_the_order_is_the_rank_s_own_and_te_takes_it_without_wgrad_graphs(
    name: str, pp: int, m: int
) -> None:
    """Without ``delay_wgrad_compute`` (the wgrad entries left out: a B then computes its dW
    inside its graph, as ``local`` does) every schedule's order passes TE's rules."""
    schedule = SCHEDULES[name].generate(pp, m)
    for rank in range(pp):
        order = cuda_graph_order(schedule, rank)
        computes = [h for a in schedule.ranks[rank] for h in a.computes]
        backwards = sum(h.kind in (Kind.B, Kind.BW) for h in computes)
        assert order.count(1) + sum(o > 1 for o in order) == sum(h.kind is Kind.F for h in computes)
        assert sum(o < 0 and o == int(o) for o in order) == backwards
        assert sum(o != int(o) for o in order) == backwards  # every backward has its wgrad
        assert all(isinstance(o, int) for o in order if o > 0)
        check_cuda_graph_order(
            [o for o in order if o == int(o)],
            schedule.placement.num_chunks,
            _per_chunk(name, pp, m),
            wgrad=False,
        )


@pytest.mark.parametrize(("name", "pp", "m"), CASES, ids=lambda v: str(v))
def test_with_wgrad_graphs_te_takes_exactly_the_orders_with_one_wgrad_waiting(
    name: str, pp: int, m: int
) -> None:
    """With wgrad graphs TE captures a ``-c-0.5`` for chunk c's latest backward, so an
    order passes exactly where no chunk has two backwards waiting for their wgrads."""
    chunks, orders = _orders(name, pp, m)
    for order in orders:
        if max_wgrads_waiting(order) <= 1:
            check_cuda_graph_order(order, chunks, _per_chunk(name, pp, m), wgrad=True)
        else:
            with pytest.raises(CudaGraphOrderError, match="would never be captured"):
                check_cuda_graph_order(order, chunks, _per_chunk(name, pp, m), wgrad=True)


def test_which_schedules_te_can_capture_with_deferred_wgrad() -> None:
    """The finding: Megatron's schedules always; zb1p never; dualpipe and dualpipev at the
    smallest sizes only (their cool-down defers several W of one chunk)."""
    capturable: dict[str, list[int]] = {name: [] for name in SCHEDULES}
    for name, pp, m in CASES:
        if m == 2 * pp and all(max_wgrads_waiting(o) <= 1 for o in _orders(name, pp, m)[1]):
            capturable[name].append(pp)
    assert capturable["1f1b"] == list(PPS)
    assert capturable["interleaved-1f1b"] == list(PPS)
    assert capturable["zb1p"] == []
    assert capturable["dualpipev"] == [2]
    assert capturable["dualpipe"] == [2, 4]


def test_dualpipev_pp4_rank0_order() -> None:
    """The example of docs/megatron.md ("CUDA graphs")."""
    order = cuda_graph_order(SCHEDULES["dualpipev"].generate(4, 8), 0)
    assert order[:13] == [1, 1, 1, 1, 1, 1, 1, 2, -2, -2.5, 2, -2, -2.5]
    assert order[-4:] == [-1, -1.5, -1, -1.5]
    assert len(order) == 2 * 8 * 3
    check_cuda_graph_order(order, 2, 8, wgrad=True)  # rank 0's order TE can capture


@pytest.mark.parametrize(
    ("order", "wgrad", "message"),
    [
        ([1, -1, 1, -1], False, None),
        ([1, -1, -1.5, 1, -1, -1.5], True, None),
        ([-1, 1, 1, -1], False, "entry 0 (-1): a backward of chunk 1 before any forward"),
        (
            [1, 1, -1, -1, -1.5, -1.5],
            True,
            "entry 3 (-1): backward 2 of chunk 1 comes before the wgrad of backward 1",
        ),
        (
            [1, -1.5, -1, 1, -1, -1.5],
            True,
            "entry 1 (-1.5): chunk 1's latest backward already has its wgrad",
        ),
        ([1, -1, -1.5], False, "entry 2 (-1.5) is a wgrad graph, and without"),
        ([1, -1, 3, -3], False, "entry 2 (3) names no chunk: write +c, -c or -c-0.5 for c in 1..2"),
        ([1, -1, 2, -2, 1, -1], False, "chunk 1 has 2 forward entries, and TE captures 1"),
        ([1.0, -1, 2, -2], False, "entry 0 (1): TE takes a forward only as a Python int"),
        ([1, -1, 2, -2], True, "chunk 1's last backward has no wgrad entry"),
    ],
)
def test_hand_made_orders(order: list[float], wgrad: bool, message: str | None) -> None:
    chunks = max(int(abs(o)) for o in order) if message is None else 2
    per_chunk = 2 if message is None else 1
    if message is None:
        check_cuda_graph_order(order, 1, per_chunk, wgrad=wgrad)
        return
    with pytest.raises(CudaGraphOrderError) as info:
        check_cuda_graph_order(order, chunks, per_chunk, wgrad=wgrad)
    assert message in str(info.value)


def test_a_broken_schedule_order_fails_naming_the_entry() -> None:
    order = cuda_graph_order(SCHEDULES["1f1b"].generate(4, 8), 0)
    first_backward = order.index(-1)
    broken = order[:]
    broken.insert(0, broken.pop(first_backward))
    with pytest.raises(CudaGraphOrderError, match=r"^entry 0 \(-1\): a backward of chunk 1"):
        check_cuda_graph_order(broken, 1, 8, wgrad=True)


def test_a_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="rank 4 is out of range 0..3"):
        cuda_graph_order(SCHEDULES["1f1b"].generate(4, 8), 4)
