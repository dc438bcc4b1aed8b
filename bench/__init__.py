"""Benchmarks, in the checkout only (not installed; they may import any of
``megatron_dualpipe``): the simulated grid of every schedule, ours and
torch.distributed.pipelining's, and measured runs on sleep-op models.

:func:`run` (:mod:`.suite`) runs the sections (:data:`SECTIONS`) and writes tables, figures
and JSON; ``python -m bench`` (:mod:`.__main__`) and ``bench/run_all.py`` call it. Importing
this package does not import torch. Its modules: docs/architecture.md; the method:
docs/benchmark-method.md.
"""

from .suite import SECTIONS, BenchContext, Section, run

__all__ = ["SECTIONS", "BenchContext", "Section", "run"]
