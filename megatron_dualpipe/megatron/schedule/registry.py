"""Selecting a pipeline schedule: :func:`get_forward_backward_func` and the opt-in
:func:`install`.

:func:`get_forward_backward_func` is Megatron's function of the same name with a
``pipeline_schedule`` argument: for a schedule our runtime runs it returns a new
:class:`~.forward_backward.DualPipeForwardBackward` (keep it: it holds the executor), for
Megatron's own (or None) Megatron's choice.

:func:`install` is a patch, for code that calls Megatron's ``get_forward_backward_func()``
itself and cannot be changed: it rebinds that name in every imported megatron module to
a function that returns one forward-backward object for the installed schedule. It is
undone by :meth:`Installation.undo` (or leaving its ``with`` block) or by
:func:`uninstall`; nothing is recorded outside the patched functions themselves.
Prefer calling :func:`get_forward_backward_func` (or building the object) directly.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from megatron.core.pipeline_parallel import schedules as megatron_schedules

from ...runtime import DEFAULT_TIMEOUT_S
from ..grads.mirror import SLICE_BYTES
from .checks import schedule_spec
from .forward_backward import DualPipeForwardBackward

__all__ = ["Installation", "get_forward_backward_func", "install", "uninstall"]

_megatron_get_forward_backward_func = megatron_schedules.get_forward_backward_func
#: Set on the functions :func:`install` puts in place, naming what they replaced.
_REPLACED = "__dualpipe_replaced__"


def get_forward_backward_func(
    pp_size: int | None = None,
    vp_size: int | None = None,
    *,
    pipeline_schedule: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    graph_safe: bool = False,
    mirror_slice_bytes: int = SLICE_BYTES,
    **megatron_kwargs: Any,
) -> Callable[..., Any]:
    """Megatron's ``get_forward_backward_func``, aware of our schedules (unknown names are
    a :class:`~.checks.DualPipeConfigError`; ``graph_safe`` and ``mirror_slice_bytes``: see
    :class:`~.forward_backward.DualPipeForwardBackward`); ``megatron_kwargs`` are
    Megatron's other keywords (0.19: ``schedule_pg_collection``), passed to Megatron's
    choice."""
    found = None if pipeline_schedule is None else schedule_spec(pipeline_schedule)
    if found is not None and found.runs_ours:
        return DualPipeForwardBackward(
            found,
            timeout_s=timeout_s,
            graph_safe=graph_safe,
            mirror_slice_bytes=mirror_slice_bytes,
        )
    return _megatron_get_forward_backward_func(pp_size, vp_size, **megatron_kwargs)


class Installation:
    """The modules :func:`install` patched; :meth:`undo` restores them."""

    def __init__(self, forward_backward: DualPipeForwardBackward | None, patched: list[Any]):
        self.forward_backward = forward_backward
        self._patched = patched

    def undo(self) -> None:
        """Give every patched module back Megatron's function."""
        for module in self._patched:
            installed = getattr(module, "get_forward_backward_func", None)
            replaced = getattr(installed, _REPLACED, None)
            if replaced is not None:
                module.get_forward_backward_func = replaced
        self._patched = []

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def _megatron_modules() -> list[types.ModuleType]:
    return [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("megatron.") and isinstance(module, types.ModuleType)
    ]


def install(pipeline_schedule: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Installation:
    """Make ``get_forward_backward_func`` in every imported megatron module return the
    forward-backward function of ``pipeline_schedule`` (ours: one object for the whole run;
    Megatron's own: Megatron's choice, unchanged). Installing again replaces the previous
    installation. Modules imported later are not patched."""
    uninstall()
    found, forward_backward = schedule_spec(pipeline_schedule), None
    if found.runs_ours:
        forward_backward = DualPipeForwardBackward(found, timeout_s=timeout_s)
    patched = []
    for module in _megatron_modules():
        original = getattr(module, "get_forward_backward_func", None)
        if original is not _megatron_get_forward_backward_func:
            continue
        module.get_forward_backward_func = _installed(forward_backward)
        patched.append(module)
    return Installation(forward_backward, patched)


def _installed(forward_backward: DualPipeForwardBackward | None) -> Callable[..., Any]:
    def get_forward_backward_func(
        pp_size: int | None = None, vp_size: int | None = None, **megatron_kwargs: Any
    ) -> Any:
        if forward_backward is None:
            return _megatron_get_forward_backward_func(pp_size, vp_size, **megatron_kwargs)
        return forward_backward

    setattr(get_forward_backward_func, _REPLACED, _megatron_get_forward_backward_func)
    return get_forward_backward_func


def uninstall() -> None:
    """Undo every :func:`install` in this process (no-op when nothing is installed)."""
    Installation(None, _megatron_modules()).undo()
