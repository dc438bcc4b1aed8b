"""The warnings of megatron-core 0.16.1 and torch 2.13 that say nothing about a run of
ours: optional fused kernels absent (Transformer Engine, apex) and deprecations inside
their own code. Our entry points that run megatron-core (``train``, ``bench``) hide them;
a library caller keeps Python's defaults. Imports neither torch nor megatron."""

from __future__ import annotations

import warnings

__all__ = ["KNOWN_WARNINGS", "silence_known_warnings"]

#: (category, message regex) of each warning hidden.
KNOWN_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed"),
    (UserWarning, r"full scope is deprecated"),
    # Selective core_attn recomputation: about Transformer Engine's fused attention.
    (UserWarning, r"If you are using transformer_engine as the transformer implementation"),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),
    (FutureWarning, r"Please use DTensor instead"),
    (FutureWarning, r"`load_state_dict` is deprecated"),
)


def silence_known_warnings() -> None:
    """Ignore :data:`KNOWN_WARNINGS` in this process and the ranks it forks from now on;
    call it before importing megatron.core (some are raised at import)."""
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
