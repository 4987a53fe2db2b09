"""Crash-safe file primitives and zarr v3 metadata for the shard store (:mod:`dflash_staged.store`).

Every file is created exclusively and written in full; files and directories are fsynced
before anything that depends on them is renamed into place (a shard's ~17 of them together, see
:func:`fsync_all`). :data:`_os_write` is the one function that writes file bytes, so tests
can monkeypatch it to simulate a full disk or a writer killed mid-write. Temp entries are named
``<prefix>~<pid>~<token>~<host>`` so that :func:`owner_dead` can tell leftovers of dead
writers from live ones. The checksum (XXH3-64, about 2x the speed of CRC32C here) is computed
block by block right after each block is read (or before it is written), while the block is
still in the CPU cache; on 2 busy cores that beat a hash thread overlapping the I/O (which
competes for a core and re-reads the block from memory). Parallelism comes from reading
several shards at once.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

from dflash_staged.fsutil import fsync_dir, fsync_path  # noqa: F401 (fsync_dir re-exported for the store)
from dflash_staged.procs import HOST, pid_alive

BLOCK = 1 << 20  # I/O block: small enough that its hash runs on cached bytes
_os_write = os.write  # the one function that writes file bytes; tests monkeypatch it (ENOSPC, crash)


def new_hash():
    """Streaming XXH3-64: ``.update(buffer)``, ``.hexdigest()`` (16 hex digits)."""
    return xxhash.xxh3_64()


def hash_hex(arr: np.ndarray) -> str:
    h = new_hash()
    h.update(arr)
    return h.hexdigest()


def combine_hex(digests: list[str]) -> str:
    """One digest over several: XXH3-64 of their 8-byte big-endian values, concatenated."""
    return hash_hex(np.frombuffer(b"".join(bytes.fromhex(d) for d in digests), dtype=np.uint8))


def bytes_view(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 numpy view of a contiguous CPU tensor's storage (no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def empty_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised CPU tensor backed by numpy memory.

    numpy madvises large buffers for transparent huge pages; torch.empty does not, and reading
    into 4 KiB pages measured about 2x slower here (page faults dominate a warm read).
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype).view(tuple(shape))


def write_file(path: Path, data, hasher=None, sync: bool = True) -> int:
    """Create ``path`` (must not exist), write all of ``data`` (bytes-like), fsync; return its size.

    ``hasher`` (from :func:`new_hash`), if given, is updated with every block before it is written.
    ``sync=False`` leaves the fsync to the caller (see :func:`fsync_all`).
    """
    mv = memoryview(data).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        pos, n = 0, len(mv)
        while pos < n:
            end = min(pos + BLOCK, n)
            if hasher is not None:
                hasher.update(mv[pos:end])
            while pos < end:
                pos += _os_write(fd, mv[pos:end])
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return n


def fsync_all(paths: list[Path]) -> None:
    """fsync files and directories concurrently, returning when all are durable.

    One fsync after another costs a journal commit each (a shard has ~17 files and directories:
    ~40% of its write time here); concurrent ones share commits.
    """
    global _sync_pool
    if _sync_pool is None:
        _sync_pool = ThreadPoolExecutor(8, thread_name_prefix="dflash-fsync")
    for fut in [_sync_pool.submit(fsync_path, p) for p in paths]:
        fut.result()


_sync_pool: ThreadPoolExecutor | None = None


def prefetch(path: Path) -> None:
    """Ask the kernel to start reading ``path`` into the page cache (asynchronous; errors ignored)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def write_json(path: Path, obj, sync: bool = True) -> None:
    write_file(path, json.dumps(obj, indent=1).encode(), sync=sync)


def group_json(attributes: dict | None = None) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def array_json(shape, data_type: str, compression: str, logical_dtype: str) -> dict:
    codec = {"name": "bytes"}
    if np.dtype(data_type).itemsize > 1:
        codec["configuration"] = {"endian": "little"}
    codecs = [codec] + (
        [{"name": "zstd", "configuration": {"level": 1, "checksum": False}}] if compression == "zstd" else []
    )
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, s) for s in shape]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": 0,
        "codecs": codecs,
        "attributes": {"logical_dtype": logical_dtype},
        "storage_transformers": [],
    }


def chunk_file(ndim: int) -> str:
    return ".".join(["c"] + ["0"] * ndim)


def temp_name(kind: str, label: str) -> str:
    return f".{kind}~{label}~{os.getpid()}~{secrets.token_hex(4)}~{HOST}"


def owner_dead(name: str, stale_s: float, path: Path, orphan=None) -> bool:
    """May temp entry ``name`` go: is the process that made it gone? Unknown hosts count as dead once
    stale, or when ``orphan(kind, label, host, pid)`` (the caller's knowledge, e.g. the manifest's) says
    so. A deletion entry (``.del~``) of this host goes unless this process made it: it is never needed
    again, and its pid alone cannot tell (after a container restart a low pid is another process's)."""
    parts = name.rsplit("~", 3)  # prefix, pid, token, host
    if len(parts) != 4 or not parts[1].isdigit():
        return False
    if parts[3] == HOST and parts[0].startswith(".del~"):
        return int(parts[1]) != os.getpid()
    if parts[3] != HOST:
        kind, _, label = parts[0].lstrip(".").partition("~")
        if orphan is not None and orphan(kind, label, parts[3], int(parts[1])):
            return True
        try:
            return time.time() - path.lstat().st_mtime > stale_s
        except FileNotFoundError:
            return False
    return not pid_alive(HOST, int(parts[1]), None)  # gone, or a zombie (killed, not yet reaped)


def zstd():
    from numcodecs import Zstd

    return Zstd(level=1, checksum=False)


class ChunkError(Exception):
    """A chunk file is missing, has the wrong size or does not decode (``truncated`` if short/missing)."""

    def __init__(self, msg: str, truncated: bool):
        super().__init__(msg)
        self.truncated = truncated


def read_chunk(path: Path, view: np.ndarray, stored: int, verify: bool, compression: str) -> str:
    """Read chunk file ``path`` (``stored`` bytes on disk) into uint8 ``view``; return its hash (""
    if not ``verify``).

    Uncompressed chunks are read straight into ``view`` (the only copy), block by block, each
    block hashed while it is in cache.
    """
    if view.size == 0:
        return hash_hex(view) if verify else ""
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise ChunkError("the file is missing", truncated=True) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != stored:
            raise ChunkError(f"has {size} bytes but its metadata says {stored}", truncated=size < stored)
        if compression == "zstd":
            try:
                zstd().decode(f.read(), out=view)
            except Exception as e:
                raise ChunkError(f"does not decompress ({e})", truncated=False) from None
            return hash_hex(view) if verify else ""
        mv, h, pos = memoryview(view), new_hash(), 0
        while pos < size:
            n = f.readinto(mv[pos : pos + BLOCK])
            if not n:
                raise ChunkError(f"ended at byte {pos} of {size}", truncated=True)
            if verify:
                h.update(mv[pos : pos + n])
            pos += n
        if pos != view.size:
            raise ChunkError(f"holds {pos} bytes, the array needs {view.size}", truncated=pos < view.size)
        return h.hexdigest() if verify else ""
