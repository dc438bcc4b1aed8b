"""Release this thread's OpenMP worker pool before a fork, so the child can run in parallel.

GNU libgomp (the OpenMP runtime of torch's Linux wheels, CPU and CUDA builds alike) keeps
the worker threads of a thread's last parallel region parked in a pool that thread owns. A
child forked from it inherits the pool's bookkeeping but none of its threads: the child's
first parallel region with two or more threads waits at a barrier for workers that do not
exist, for ever. The embedded launcher met it: a one-rank run (two intra-op threads on two
cores) forked after its parent had run ``torch.zeros(10**6)`` on two threads hung in the
rank's first ``torch.zeros``, in ``gomp_team_barrier_wait_end``, with no timeout to end it.

OpenMP 5.0's ``omp_pause_resource_all(omp_pause_hard)`` frees the calling thread's pool
while its threads are alive; the parent's next parallel region builds a new one, and a child
forked in between starts without one. LLVM's and Intel's runtimes reset themselves in the
child (a ``pthread_atfork`` handler), so only libgomp is asked. Linux only (``/proc``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

__all__ = ["loaded_libgomp", "release_thread_pool"]

#: ``omp_pause_hard`` of ``omp_pause_resource_t`` (OpenMP 5.0, omp.h).
_PAUSE_HARD = 2


def release_thread_pool() -> bool:
    """Free the calling thread's libgomp worker pool (call outside any parallel region,
    just before forking); whether a loaded libgomp did. A no-op without libgomp, or with
    one older than OpenMP 5.0."""
    released = False
    for path in loaded_libgomp():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all  # the loaded copy, not a new one
        except (OSError, AttributeError):
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        released |= pause(_PAUSE_HARD) == 0
    return released


def loaded_libgomp() -> list[str]:
    """The paths of the libgomp copies mapped into this process (torch's wheels ship their
    own, ``torch/lib/libgomp*.so*``), from ``/proc/self/maps``; none off Linux."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    fields = (line.split(maxsplit=5) for line in maps.splitlines() if "libgomp" in line)
    paths = {f[5] for f in fields if len(f) == 6}  # address, perms, offset, dev, inode, path
    return sorted(p for p in paths if Path(p).name.startswith("libgomp"))
