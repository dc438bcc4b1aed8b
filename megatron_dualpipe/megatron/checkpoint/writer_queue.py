"""A checkpoint writer's results queue whose manager process dies with the rank.

dist_checkpointing's ``torch_dist`` save makes a results queue on its first save
(``filesystem_async.get_write_results_queue`` in 0.19, ``_get_write_results_queue`` in
0.16.1): a manager process spawned per rank and kept, in the module's cache
``_results_queue`` (named so in both), for every later save. A spawned process does not
run the fork hooks of :func:`~megatron_dualpipe.lifetime.forks_die_with_forker`, so a
``kill -9`` of the whole run (launcher, guard and ranks at once) left each rank's manager,
and the resource tracker that waits on the manager's end of its pipe, running under PID 1.
:func:`writer_queue_dies_with_rank` fills that cache first with the same kind of queue from
a manager started with :func:`~megatron_dualpipe.lifetime.die_with_parent` as its
initializer: dist_checkpointing takes no queue from its caller, and the cache it reads first
is the only way in.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.managers
import os

from megatron.core.dist_checkpointing.strategies import filesystem_async

from ...lifetime import die_with_parent

__all__ = ["writer_queue_dies_with_rank"]


def writer_queue_dies_with_rank() -> None:
    """Give dist_checkpointing's writer, where it has none yet, a results queue whose
    manager process dies with this one (see the module docstring)."""
    if filesystem_async._results_queue is not None:
        return
    manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
