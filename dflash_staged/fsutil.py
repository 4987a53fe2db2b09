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


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 1) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically: temp file, fsync, rename."""
    import json
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=indent) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of all files under ``path`` (0 if absent); files vanishing meanwhile are skipped."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total
