"""Benchmarks (entry-point layer): the simulated grid of every schedule, ours and
torch.distributed.pipelining's, and measured runs on sleep-op models.

- :func:`run` (:mod:`.suite`) runs the sections (:data:`SECTIONS`), writes tables, figures, JSON;
  ``megatron-dualpipe bench`` and ``bench/run_all.py`` call it.
- :mod:`.simulated` (grid rows and tables), :mod:`.plots`, :mod:`.catalog` (schedules and
  cost profiles): imports only the schedule layer and ``bench.torch_schedules``.
- :mod:`.sleep_model` (layers whose F, dX and dW passes are timed sleeps), :mod:`.launch`
  (forked CPU+gloo ranks with a deadline), :mod:`.peers` (torch's runtime measured).
- :mod:`.measured` (Megatron-Core's 1F1B and interleaved schedules, torch's and ours
  measured in one interleaved run; Megatron runs the same stages through
  :mod:`megatron_dualpipe.megatron.model.module_chunks`), its
  tables and statements in :mod:`.measured_report`.

Importing this package does not import torch; the sections import what they need.
"""

from .suite import SECTIONS, BenchContext, Section, run

__all__ = ["SECTIONS", "BenchContext", "Section", "run"]
