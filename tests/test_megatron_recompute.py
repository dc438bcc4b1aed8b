"""Megatron-Core's activation recomputation under our schedules: the same losses and
gradients as the unpipelined run without recomputation, every weight gradient still
deferred to its W (a recomputed layer's forward runs inside the B that needs it, and its dW
goes to the store like any other), and a lower measured peak of saved activations.

Each case is one training step of the tiny 8-layer GPT through
``tests/megatron_harness.py`` (DDP, dW deferral), compared with the one-process reference
by parameter name (relative error <= 1e-5). ``deferred`` counts the dW work items handed to
the store on each rank: without the recomputed layers' deferral, full recomputation leaves
only the output layer's.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.megatron_harness import CPU_ONLY, Layout, Model, _check

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc, CPU_ONLY]

FULL_UNIFORM = (
    ("recompute_granularity", "full"),
    ("recompute_method", "uniform"),
    ("recompute_num_layers", 1),
)
FULL_BLOCK = (
    ("recompute_granularity", "full"),
    ("recompute_method", "block"),
    ("recompute_num_layers", 1),
)
SELECTIVE = (("recompute_granularity", "selective"), ("recompute_modules", ["core_attn", "mlp"]))
SELECTIVE_MOE = (("recompute_granularity", "selective"), ("recompute_modules", ["moe"]))
SELECTIVE_CORE_ATTN = (("recompute_granularity", "selective"),)
#: Selective ``mlp`` recomputation needs linear layers without biases (see config.py).
NO_BIAS = Model(bias=False)


@functools.cache
def _run(model: Model, schedule: str, recompute: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    layout = Layout(pp=2, schedule=schedule, ddp=True, recompute=recompute)
    return _check(model, layout, schedule)


def _freeze(recompute: tuple) -> tuple:
    """Hashable (lists as tuples) for the cache; TransformerConfig takes either."""
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in recompute)


CASES = [
    pytest.param(Model(), "dualpipev", FULL_UNIFORM, id="dualpipev-full-uniform"),
    pytest.param(NO_BIAS, "dualpipev", SELECTIVE, id="dualpipev-selective", marks=pytest.mark.slow),
    pytest.param(
        Model(), "dualpipev", FULL_BLOCK, id="dualpipev-full-block", marks=pytest.mark.slow
    ),
    pytest.param(
        Model(), "dualpipev", SELECTIVE_CORE_ATTN, id="dualpipev-core-attn", marks=pytest.mark.slow
    ),
    pytest.param(
        Model(moe=True), "dualpipev", SELECTIVE_MOE, id="dualpipev-moe", marks=pytest.mark.slow
    ),
    pytest.param(Model(), "zb1p", FULL_UNIFORM, id="zb1p-full-uniform", marks=pytest.mark.slow),
    pytest.param(NO_BIAS, "dualpipe", SELECTIVE, id="dualpipe-selective", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("model", "schedule", "recompute"), CASES)
def test_recomputation_keeps_the_math_and_the_deferral_and_lowers_the_peak(
    model: Model, schedule: str, recompute: tuple
) -> None:
    plain = _run(model, schedule, ())
    recomputed = _run(model, schedule, _freeze(recompute))  # equal to the reference (asserted)
    assert recomputed["grad"] <= 1e-5 and recomputed["loss"] <= 1e-5
    # Every dW deferred without recomputation is deferred with it.
    assert recomputed["deferred"] == plain["deferred"], (recomputed["deferred"], plain["deferred"])
    lower = [r < p for r, p in zip(recomputed["peak_bytes"], plain["peak_bytes"], strict=True)]
    assert all(lower), (recomputed["peak_bytes"], plain["peak_bytes"])
    print(
        f"{schedule} {dict(recompute)}: peak saved bytes per rank {plain['peak_bytes']} -> "
        f"{recomputed['peak_bytes']}"
    )
