"""megatron-dualpipe: DualPipe and DualPipeV pipeline schedules for Megatron-Core."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .megatron.schedule.registry import Installation

__version__ = "0.1.0"


def install(pipeline_schedule: str, *, timeout_s: float = 600.0) -> Installation:
    """Opt-in patch: make ``get_forward_backward_func`` in every imported megatron module
    return ``pipeline_schedule``'s forward-backward function (for code that cannot call
    ours directly). Undo it with the returned object's ``undo()``, its ``with`` block, or
    :func:`uninstall`. See ``megatron_dualpipe.megatron.schedule.registry``."""
    from .megatron.schedule.registry import install as _install

    return _install(pipeline_schedule, timeout_s=timeout_s)


def uninstall() -> None:
    """Undo :func:`install` (no-op when nothing is installed)."""
    from .megatron.schedule.registry import uninstall as _uninstall

    _uninstall()
