"""megatron-dualpipe: DualPipe and DualPipeV pipeline schedules for Megatron-Core."""

from __future__ import annotations

__version__ = "0.1.0"


def install(pipeline_schedule: str | None = None) -> None:
    """Register our schedules with Megatron-Core: every ``get_forward_backward_func`` that
    megatron modules imported returns ours for ``zb1p``, ``dualpipe``, ``dualpipev``.
    Idempotent; ``pipeline_schedule`` records the run's schedule (see
    ``megatron_dualpipe.megatron.registry``)."""
    from .megatron.registry import install as _install

    _install(pipeline_schedule)
