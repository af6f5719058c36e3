"""Files the processes of one gateway share in its private directory: written whole, read newest.

A worker's admin state, the config it runs, and the parent's count of its workers are files
another process reads at any moment: each is written to ``<name>.partial`` and renamed into
place, so a reader finds the old content or the new, never half.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["newest", "write_whole"]


def write_whole(path: Path, data: bytes) -> None:
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def newest(paths: Iterable[Path]) -> Path | None:
    """The most recently written of ``paths`` (None if there are none)."""
    return max(paths, key=lambda path: path.stat().st_mtime_ns, default=None)
