"""Durability helpers shared by every writer (manifest, store, checkpoints, drafter weights).

The rule everywhere: write under a temporary name, fsync the files, rename into place, fsync
the parent directory. These two functions are the fsync half of it.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory; see :func:`fsync_path`."""
    fsync_path(Path(path))
