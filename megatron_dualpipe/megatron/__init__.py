"""Megatron-Core integration: the only package of megatron_dualpipe that imports megatron.core.

Import its submodules explicitly (``megatron_dualpipe.megatron.compat.cpu_compat``,
``megatron_dualpipe.megatron.model.chunks``); importing this package alone imports
neither torch nor megatron. It refuses a megatron-core release outside the supported range
(:data:`.version.SUPPORTED_MEGATRON_CORE`) here, in one sentence, before any of its modules
meets megatron-core.
"""

from .compat.version import refuse_unsupported_at_import

refuse_unsupported_at_import()
