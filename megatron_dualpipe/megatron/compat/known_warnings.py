"""The warnings of megatron-core (0.16.1 to 0.19.x) and torch 2.13 that say nothing about a
run of ours: optional packages absent (Transformer Engine, apex, absl), deprecations and
experimental notices inside their own code, and megatron-core 0.19's logged notice that
GPTModel takes bug fixes only (the model we build; docs/megatron-versions.md). Our entry
points that run megatron-core (``train``; ``python -m bench`` in the checkout) hide them; a
library caller keeps Python's defaults. Imports neither torch nor megatron."""

from __future__ import annotations

import logging
import warnings

__all__ = ["KNOWN_LOG_RECORDS", "KNOWN_WARNINGS", "silence_known_warnings"]

#: (category, message regex) of each warning hidden.
KNOWN_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed"),
    (UserWarning, r"full scope is deprecated"),
    # Selective core_attn recomputation: about Transformer Engine's fused attention.
    (UserWarning, r"If you are using transformer_engine as the transformer implementation"),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),
    (FutureWarning, r"Please use DTensor instead"),
    (FutureWarning, r"`load_state_dict` is deprecated"),
    (UserWarning, r"absl\.logging is not installed"),
    (UserWarning, r"MimoModelConfig is experimental"),
)
#: (logger, message start) of each logged warning hidden.
KNOWN_LOG_RECORDS: tuple[tuple[str, str], ...] = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    # torch's CUDA build on a machine without a GPU, when megatron-core 0.19 imports it.
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
)


class _Hidden(logging.Filter):
    """Drops the records whose message starts with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def silence_known_warnings() -> None:
    """Ignore :data:`KNOWN_WARNINGS` and :data:`KNOWN_LOG_RECORDS` in this process and the
    ranks it forks from now on; call it before importing megatron.core (some are raised at
    import). Idempotent."""
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, start in KNOWN_LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Hidden) and f.start == start for f in logger.filters):
            logger.addFilter(_Hidden(start))
