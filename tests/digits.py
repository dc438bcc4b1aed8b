"""How equal two runs' losses must be, by what is claimed (docs/training.md, "The same losses:
exactly what is equal"): the same printed digits where the claim is exact (one schedule run
twice, or schedules that accumulate in the same order with clipping off or on the same
placement), a stated relative tolerance where it is not. With clipping on, runs whose
placements differ (another schedule, or the unpipelined reference) agree to about 1e-7: the
gradient norm's float32 sum depends on which layers share a rank and on the machine's kernels
(AVX2 against AVX-512), so their 7th printed digit passes or fails by machine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["CLIPPED_ACROSS_PLACEMENTS", "beyond", "printed", "printed_differently"]

#: The relative agreement claimed for clipped runs whose placements differ.
CLIPPED_ACROSS_PLACEMENTS = 1e-6


def printed(loss: float) -> str:
    """A loss as Megatron-LM prints it (7 significant digits)."""
    return f"{loss:.6E}"


def _pairs(losses, reference) -> list[tuple[object, float, float]]:
    if isinstance(losses, Mapping):
        assert set(losses) <= set(reference), (
            f"no reference for {sorted(set(losses) - set(reference))}"
        )
        return [(i, losses[i], reference[i]) for i in sorted(losses)]
    assert len(losses) == len(reference), (len(losses), len(reference))
    return list(zip(range(len(losses)), losses, reference, strict=True))


def printed_differently(
    losses: Mapping[int, float] | Sequence[float], reference: Mapping[int, float] | Sequence[float]
) -> dict[object, tuple[str, str]]:
    """The iterations whose printed loss differs from the reference's (an exact claim)."""
    return {
        i: (printed(a), printed(b))
        for i, a, b in _pairs(losses, reference)
        if printed(a) != printed(b)
    }


def beyond(
    losses: Mapping[int, float] | Sequence[float],
    reference: Mapping[int, float] | Sequence[float],
    rel: float = CLIPPED_ACROSS_PLACEMENTS,
) -> dict[object, tuple[str, str, float]]:
    """The iterations whose loss differs from the reference's by more than ``rel`` relative."""
    return {
        i: (printed(a), printed(b), abs(a - b) / abs(b))
        for i, a, b in _pairs(losses, reference)
        if abs(a - b) > rel * abs(b)
    }
