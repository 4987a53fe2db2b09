"""Crash-safe file primitives and zarr v3 metadata for the shard store (:mod:`dflash_staged.store`).

Every file is created exclusively and written in full; files and directories are fsynced
before anything that depends on them is renamed into place (a shard's ~17 of them together, see
:func:`fsync_all`). :data:`_os_write` is the one function that writes file bytes, so tests
can monkeypatch it to simulate a full disk or a writer killed mid-write. Temp entries are named
``<prefix>~<pid>~<token>~<host>`` so that :func:`owner_dead` can tell leftovers of dead
writers from live ones. The checksum (XXH3-64, about 2x the speed of CRC32C here) is computed
block by block before each block is written, while it is in the CPU cache. A read digests what it
reads as :func:`_read_hashed` says: a small file block by block in line, a large one on a thread
beside the reads (in line it cost a warm read 0.91 of a plain read, read and digest on one core;
beside them, 0.95). Parallelism otherwise comes from reading several shards at once.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import queue
import secrets
import threading
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

    Uncompressed chunks are read straight into ``view`` (the only copy) by :func:`_read_hashed`.
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
        h = new_hash()
        pos = _read_hashed(f.fileno(), memoryview(view), size, h if verify else None)
        if pos != view.size:
            raise ChunkError(f"holds {pos} bytes, the array needs {view.size}", truncated=pos < view.size)
        return h.hexdigest() if verify else ""


def _read_hashed(fd: int, mv: memoryview, size: int, h) -> int:
    """Read the file's ``size`` bytes into ``mv``, updating ``h`` (None: no digest) in order; returns the
    bytes read.

    * A file under :data:`OVERLAP_MIN` bytes is read and digested a :data:`BLOCK` at a time, each block
      while it is in the CPU's cache.
    * A larger file is digested on a thread of its own, each span while the next is read (xxhash releases
      the GIL), so the digest costs no read time where a core is free. How it is read depends on whether
      the page cache holds it (:func:`_cached`, which asks the kernel about a few of its pages):
    * cached, a block at a time without waiting for the disk (``RWF_NOWAIT``), digested a few blocks
      (:data:`SPAN`) at a time while they are in the CPU's cache; a block the cache lacks after all is
      read waiting for it, and after :data:`MISSES` of those the rest is read as if not cached;
    * not cached, in large reads (half of what is left, at most :data:`MAX_READ`, at least a block): from
      the disk a large read gets its throughput where 1 MiB reads got about 0.85 of it here; as the reads
      shrink toward the end, the last span, which nothing overlaps, is a block.
    """
    if size < OVERLAP_MIN:
        pos = 0
        while pos < size:
            n = os.preadv(fd, [mv[pos : pos + BLOCK]], pos)
            if not n:
                raise ChunkError(f"ended at byte {pos} of {size}", truncated=True)
            if h is not None:
                h.update(mv[pos : pos + n])
            pos += n
        return pos
    hasher = _Behind(h) if h is not None else None
    pos = done = misses = 0
    cached = _cached(fd, size)
    try:
        while pos < size:
            if cached:
                try:
                    n = os.preadv(fd, [mv[pos : pos + BLOCK]], pos, _NOWAIT)
                except OSError:  # this block is not in the page cache (or it would start a readahead)
                    misses += 1
                    cached = misses < MISSES
                    n = os.preadv(fd, [mv[pos : pos + BLOCK]], pos)
            else:
                step = min(MAX_READ, max(BLOCK, (size - pos) // 2))
                n = os.preadv(fd, [mv[pos : pos + step]], pos)
            if not n:
                raise ChunkError(f"ended at byte {pos} of {size}", truncated=True)
            pos += n
            if hasher is not None and (pos - done >= SPAN or not cached or pos >= size):
                hasher.put(mv[done:pos])
                done = pos
    finally:
        if hasher is not None:
            hasher.close()
    return pos


def _cached(fd: int, size: int, probes: int = 8) -> bool:
    """Whether the page cache holds the file: all but one of ``probes`` pages spread over it are resident
    (``mincore``, which starts no read, where a one-byte ``RWF_NOWAIT`` read would start a readahead at
    each probe and scatter the disk's work). False where ``mincore`` cannot be called."""
    if _NOWAIT is None or _libc is None:
        return False
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return False
    try:
        vec, hits = ctypes.create_string_buffer(1), 0
        for k in range(probes):
            page = (size * k // probes) // mmap.PAGESIZE * mmap.PAGESIZE
            if _libc.mincore(addr + page, 1, vec) == 0:
                hits += vec.raw[0] & 1
        return hits >= probes - 1
    finally:
        _libc.munmap(addr, size)


def _load_libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()
_MAP_FAILED = ctypes.c_void_p(-1).value
_NOWAIT = getattr(os, "RWF_NOWAIT", None)
OVERLAP_MIN = 16 * BLOCK  # files this big are digested on a thread beside the reads
SPAN = 4 * BLOCK  # what the digest thread is handed at a time from the page cache (0.97 of a plain read
# warm here, against 0.95 a block at a time and 0.93 in line)
MISSES = 8  # blocks a cached file may lack before the rest is read as not cached
MAX_READ = 256 * BLOCK  # the largest read from the disk (half of what is left: cold shard reads at 0.99 of
# one plain read each here, against 0.92 with a quarter, at most 64 MiB, and 0.85 a block at a time)


class _Behind:
    """Feeds spans, in order, to a hash on a thread of its own (see :func:`read_chunk`)."""

    def __init__(self, h):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.t = threading.Thread(target=self._run, args=(h,), name="dflash-digest", daemon=True)
        self.t.start()

    def _run(self, h) -> None:
        while (span := self.q.get()) is not None:
            h.update(span)

    def put(self, span) -> None:
        self.q.put(span)

    def close(self) -> None:
        """Returns once every span handed over is hashed."""
        self.q.put(None)
        self.t.join()
