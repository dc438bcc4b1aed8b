"""Whether this process can write under a folder: a probe file made and removed (asked of
the folders a run writes, save, data_cache_path, tensorboard_dir, output_dir, before the
run writes there)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["unwritable"]


def unwritable(path: str | Path) -> str | None:
    """Why this process cannot create files under ``path`` (made if missing), or None."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test.{os.getpid()}"
        probe.write_bytes(b"megatron-dualpipe")
        probe.unlink()
    except OSError as err:
        return err.strerror or str(err)
    return None
