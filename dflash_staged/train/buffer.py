"""The trainer's random-draw buffer of admitted shards.

The trainer admits ``written`` shards from the manifest (oldest first) into this
buffer, up to its capacity C; a background thread reads and verifies each
admitted shard, so the training step rarely waits on disk. Each draw takes a
shard uniformly at random, with a seeded ``torch.Generator``, from the entries
whose bucket is not yet in the current optimizer step, or from all entries when
every bucket is taken. Membership is decided on the caller's thread only, so
given the same admissions and generator state the draws are identical (replay
determinism, resume equality); only the reading happens in the background.

Host memory is bounded by C shards plus the read-ahead of the loader thread.

**Pinned shards.** When the trainer runs on CUDA, the reader thread also copies each shard's
per-token tensors (``hidden``, ``input_ids``, ``loss_mask``) into page-locked memory, so the
step's ``.to(device, non_blocking=True)`` is a DMA that overlaps compute (from pageable memory
it is a synchronous copy; the small tensors the step derives, such as ``input_ids.long()``,
stay pageable). The cost is page-locked host memory: torch's pinned allocator rounds each block
up to a power of two and keeps freed blocks for reuse, so expect about twice the buffer's shard
bytes locked per rank. A shard that cannot be pinned (the allocator refuses) is used as read,
with one warning.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dataclasses
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from dflash_staged.manifest import Job


def bound_host_memory(threshold: int = 1 << 20) -> None:
    """Serve allocations >= 1 MiB (shard tensors) with mmap, returned to the OS when freed.

    glibc raises its mmap threshold after the first large free, so shard-sized buffers read on
    several threads end up in per-thread heap arenas that fragment and keep RSS growing with the
    data size (measured: 2.6x RSS at 10x data in bench/pipeline_bench.py; flat with this).
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


PINNED_FIELDS = ("hidden", "input_ids", "loss_mask", "hidden_scale")  # what a step copies to the device


def pin_by_default() -> bool:
    """Whether a buffer pins its shards unless told: CUDA is available and this process has
    initialised it (the trainer does, choosing a CUDA device); never for a CPU run."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def pinned(shard):
    """``shard`` with its :data:`PINNED_FIELDS` copied into page-locked memory (raises RuntimeError
    where that is impossible: no CUDA, or the allocator refuses)."""
    fields = {k: getattr(shard, k, None) for k in PINNED_FIELDS}
    return dataclasses.replace(shard, **{k: v.pin_memory() for k, v in fields.items() if v is not None})


def ram_line(capacity: int, largest_shard: int, fp8: bool, pin: bool) -> str:
    """The buffer's host-memory ceiling in words: ``capacity`` shards of at most ``largest_shard`` bytes
    (read as stored: FP8 states stay one byte a value here and are dequantized on the device)."""
    from dflash_staged.manifest.status import human_bytes

    each, total = human_bytes(largest_shard), human_bytes(capacity * largest_shard)
    line = f"shard buffer: {capacity} shards x at most {each} = {total} of host RAM"
    if pin:
        line += ", about twice that page-locked"
    if fp8:
        line += "; FP8 states stay one byte a value until the device: about twice the shards in the RAM"
    return line


@dataclass
class Entry:
    job: Job
    future: cf.Future = field(repr=False)

    @property
    def bucket(self) -> int:
        return self.job.bucket


class ShardBuffer:
    """Admitted shards, read ahead in the background, drawn at random."""

    def __init__(
        self, store, capacity: int, *, verify: bool = True, readers: int = 2, pin: bool | None = None
    ):
        """``pin``: read shards into page-locked memory (see the module docstring); None =
        :func:`pin_by_default`."""
        self.store = store
        self.capacity = capacity
        self.verify = verify
        self.pin = pin_by_default() if pin is None else pin
        self.pin_warned = False
        self._warn_lock = threading.Lock()
        self.entries: list[Entry] = []
        self.to_readmit: list[int] = []  # a checkpoint's contents, before resume re-admits them
        # the readers pin on this thread's GPU (the trainer's), never on a default device 0
        gpu = torch.cuda.current_device() if self.pin and torch.cuda.is_initialized() else None
        self.pool = cf.ThreadPoolExecutor(
            max_workers=readers,
            thread_name_prefix="shard-read",
            initializer=None if gpu is None else torch.cuda.set_device,
            initargs=() if gpu is None else (gpu,),
        )

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def free(self) -> int:
        return max(0, self.capacity - len(self.entries))

    def job_ids(self) -> list[int]:
        return [e.job.id for e in self.entries]

    per_rank = True  # each rank's buffer is its own (train.checkpoint.Stateful)

    def state_dict(self) -> dict:
        return {"buffer": self.job_ids()}

    def load_state_dict(self, state) -> None:
        """Remember the checkpointed contents; the trainer re-admits them through its source once
        the manifest is reconciled (:attr:`to_readmit`)."""
        self.to_readmit = [int(i) for i in state["buffer"]]

    def admit(self, jobs: list[Job]) -> None:
        """Add taken jobs (in order) and start reading them."""
        for job in jobs:
            self.entries.append(Entry(job, self.pool.submit(self._read, job)))

    def _read(self, job: Job):
        """Read (and verify) one shard on a reader thread; pin it when :attr:`pin` is set."""
        shard = self.store.read_shard(job.epoch, job.id, job.checksum, self.verify)
        if not self.pin:
            return shard
        try:
            return pinned(shard)
        except RuntimeError as e:
            with self._warn_lock:
                first, self.pin_warned = not self.pin_warned, True
            if first:
                print(
                    f"train: warning: shards cannot be pinned ({e}); host-to-GPU copies stay synchronous",
                    file=sys.stderr,
                    flush=True,
                )
            return shard

    def draw(self, exclude_buckets: set[int], gen: torch.Generator, prefer_read: bool = False) -> Entry:
        """Remove and return a uniformly random entry, preferring buckets not in `exclude_buckets`.

        With `prefer_read` (the live trainer), entries whose background read has finished are
        preferred among those, so a step rarely waits on disk; replay leaves it off, keeping its
        draws a pure function of the admissions and the generator.
        """
        if not self.entries:
            raise IndexError("draw from an empty buffer")
        candidates = [i for i, e in enumerate(self.entries) if e.bucket not in exclude_buckets] or list(
            range(len(self.entries))
        )
        if prefer_read:
            candidates = [i for i in candidates if self.entries[i].future.done()] or candidates
        k = int(torch.randint(len(candidates), (1,), generator=gen).item())
        return self.entries.pop(candidates[k])

    @staticmethod
    def load(entry: Entry):
        """The shard of a drawn entry (waits for its read; raises ShardError if it is bad) and the wait in
        s."""
        t0 = time.perf_counter()
        shard = entry.future.result()
        return shard, time.perf_counter() - t0

    def close(self) -> None:
        for e in self.entries:
            e.future.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)
