"""Durable files and directories, the one way every writer makes them.

The rule everywhere: write under a temporary name next to the final one, fsync the files, rename
into place, fsync the parent directory. :func:`atomic_write` does it for a file,
:func:`atomic_dir` for a directory built in place; a reader sees the old version or the new
one, never a part. Temporary names are ``.<name>.tmp-<pid>-<random>``, so a later writer can
remove the leftovers of a dead one (:func:`remove_dead_temps`). The shard store, which batches
the fsyncs of a shard's many files, keeps its own names (:mod:`dflash_staged.store.shardfiles`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
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


def temp_sibling(path: Path) -> Path:
    """A fresh temporary name next to ``path``: ``.<name>.tmp-<pid>-<random>``."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def remove_dead_temps(path: Path) -> int:
    """Remove temporaries of ``path`` (see :func:`temp_sibling`) whose writing process is gone."""
    from dflash_staged.procs import HOST, pid_alive

    n = 0
    for old in Path(path).parent.glob(f".{Path(path).name}.tmp-*"):
        pid = old.name[len(Path(path).name) + 6 :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(HOST, int(pid), None):
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
            n += 1
    return n


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` durably and atomically (temp file, fsync, rename, fsync parent)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_figure_atomic(path: str | os.PathLike, fig, dpi: int = 100) -> Path:
    """Render a matplotlib figure as PNG, close it, and write it with :func:`atomic_write`."""
    import io

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return atomic_write(path, buf.getvalue())


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 1) -> Path:
    """Write ``obj`` as JSON to ``path`` with :func:`atomic_write`."""
    return atomic_write(path, json.dumps(obj, indent=indent) + "\n")


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Build directory ``path`` atomically: yields a temporary sibling to fill; on success every
    file and directory in it is fsynced, it is renamed to ``path`` and the parent is fsynced.
    An existing ``path`` is replaced (only once the new one is complete) if ``replace``, else the
    rename fails. On any error the temporary directory is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        old = None
        if replace and path.exists():
            old = temp_sibling(path)
            os.replace(path, old)
        os.rename(tmp, path)
        fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
