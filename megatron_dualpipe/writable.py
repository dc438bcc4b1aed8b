"""Whether this process can write under a folder: a probe file made and removed (asked of
the folders a run writes, save, data_cache_path, tensorboard_dir, the timeline's, before
the run writes there)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["unwritable"]


def unwritable(path: str | Path) -> str | None:
    """Why this process cannot create files under ``path`` (made if missing), or None."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # A name no other process takes (ranks on other nodes may share the folder and a pid).
        held, probe = tempfile.mkstemp(prefix=".write-test.", dir=directory)
        try:
            os.write(held, b"megatron-dualpipe")
        finally:
            os.close(held)
            os.unlink(probe)
    except OSError as err:
        return err.strerror or str(err)
    return None
