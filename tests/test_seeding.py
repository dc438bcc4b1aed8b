"""Which 1F1B pipeline rank's initial values each dualpipev chunk takes
(:func:`megatron_dualpipe.megatron.model.seeding.one_f_one_b_owners`): the rank of
Megatron's even 1F1B split holding the chunk's layers, where every chunk's layers lie in
one such rank's; otherwise none. (The values themselves: Megatron-LM's loop from scratch in
``tests/test_megatron_lm_loop.py``.)"""

from __future__ import annotations

import pytest

from megatron_dualpipe.megatron.model.seeding import one_f_one_b_owners
from megatron_dualpipe.megatron.schedule.checks import pipeline_setup

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize(
    ("v_layers", "pp", "owners"),
    [
        # PP=2, 4 layers: V stages 0..3 of one layer; 1F1B ranks hold 0-1 and 2-3.
        ((1, 1, 1, 1), 2, [[0, 1], [0, 1]]),
        # PP=4, 16 layers, even: rank r's chunks are stages r and 7-r.
        ((2,) * 8, 4, [[0, 3], [0, 3], [1, 2], [1, 2]]),
    ],
)
def test_an_even_v_split_takes_the_values_of_the_1f1b_rank_holding_each_chunk(
    v_layers: tuple[int, ...], pp: int, owners: list[list[int]]
) -> None:
    assert one_f_one_b_owners(pipeline_setup("dualpipev", pp, v_layers)) == owners


@pytest.mark.parametrize(
    ("v_layers", "pp"),
    [
        ((1, 2, 2, 2), 2),  # 7 layers: 1F1B's own split is not even
        ((1, 4, 1, 2), 2),  # stage 1 holds layers 1-4, of 1F1B's ranks 0 and 1
    ],
)
def test_a_split_across_1f1b_ranks_has_no_owner(v_layers: tuple[int, ...], pp: int) -> None:
    assert one_f_one_b_owners(pipeline_setup("dualpipev", pp, v_layers)) is None
