"""The megatron-core release that the version-specific code of this package was written
against, and the one-sentence refusal of any other release.

Two parts of the adapter follow megatron-core's internals closely: the CPU compatibility
layer (:mod:`.cpu_compat`) and the autograd function of the deferrable linear layers
(:mod:`.deferral`), which reproduces Megatron's
``linear_with_grad_accumulation_and_async_allreduce``. Each calls
:func:`require_pinned_megatron_core` when it is used.
"""

from __future__ import annotations

from ..errors import DualPipeError

__all__ = [
    "PINNED_MEGATRON_CORE",
    "MegatronVersionError",
    "installed_megatron_core",
    "null_tokenizer_library",
    "require_pinned_megatron_core",
]

#: The megatron-core release ``cpu_compat`` and ``deferral`` follow (setup.py pins it too).
PINNED_MEGATRON_CORE = "0.16.1"


class MegatronVersionError(DualPipeError, RuntimeError):
    """Version-specific code met a megatron-core release it was not written for."""


def installed_megatron_core() -> str:
    """``megatron.core.__version__`` of the megatron-core imported in this process."""
    from megatron import core

    return str(core.__version__)


def require_pinned_megatron_core(
    what: str, otherwise: str, error: type[DualPipeError] = MegatronVersionError
) -> None:
    """Raise ``error`` unless megatron-core is :data:`PINNED_MEGATRON_CORE`, in one sentence:
    ``what`` is written for that release, which release is installed, and what to do
    (install the pinned release, or ``otherwise``)."""
    found = installed_megatron_core()
    if found != PINNED_MEGATRON_CORE:
        raise error(
            f"{what} is written for megatron-core {PINNED_MEGATRON_CORE} but megatron-core "
            f"{found} is installed: pip install 'megatron-core=={PINNED_MEGATRON_CORE}' "
            f"or {otherwise}"
        )


def null_tokenizer_library() -> str:
    """The metadata ``library`` that selects Megatron-Core's NullTokenizer in
    ``MegatronTokenizer.from_pretrained``: ``null`` in 0.16.1, ``null-text`` once the text
    and vision tokenizer libraries were split (0.19.x, whose ``megatron_tokenizer`` module
    lists ``TEXT_LIBRARIES``)."""
    from megatron.core.tokenizers import megatron_tokenizer

    return "null-text" if hasattr(megatron_tokenizer, "TEXT_LIBRARIES") else "null"
