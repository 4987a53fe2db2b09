"""Where a shard store keeps its shards, which ones it holds, and what they weigh.

The layout itself is specified in :mod:`dflash_staged.store.shard_store`; :class:`StorePaths` is the
base that the store's writing (:mod:`~dflash_staged.store.write`), reading
(:mod:`~dflash_staged.store.read`) and cleanup (:mod:`~dflash_staged.store.cleanup`) share.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from dflash_staged.fsutil import dir_bytes
from dflash_staged.store.meta import LOGICAL_DTYPES, StoreMeta, bytes_per_token


class StorePaths:
    """A store directory and its metadata: shard paths, the listing of published shards, sizes."""

    def __init__(self, root: str | os.PathLike, meta: StoreMeta):
        self.root = Path(root)
        self.meta = meta
        self._torch_dtype, self._hidden_zdtype = LOGICAL_DTYPES[meta.logical_dtype]
        if meta.fp8:  # e4m3 bit patterns (zarr 3.1 has no float8)
            self._hidden_zdtype = "uint8"

    @property
    def torch_dtype(self):
        """The store's logical dtype (the target's), which FP8 states are dequantized into."""
        return self._torch_dtype

    def shard_path(self, epoch: int, job_id: int) -> Path:
        return self.root / "shards" / f"e{int(epoch)}" / f"j{int(job_id)}"

    def has_shard(self, epoch: int, job_id: int) -> bool:
        return (self.shard_path(epoch, job_id) / "zarr.json").is_file()

    def iter_shards(self) -> Iterator[tuple[int, int]]:
        """(epoch, job_id) of every published shard, in no particular order."""
        for edir in (self.root / "shards").glob("e*"):
            for jdir in edir.glob("j*"):
                if edir.name[1:].isdigit() and jdir.name[1:].isdigit() and (jdir / "zarr.json").is_file():
                    yield int(edir.name[1:]), int(jdir.name[1:])

    def estimate_nbytes(self, num_tokens: int, num_samples: int) -> int:
        """Uncompressed chunk bytes of a shard with these sizes."""
        return num_tokens * self.bytes_per_token + (2 * num_samples + 1) * 8

    @property
    def bytes_per_token(self) -> int:
        m = self.meta
        return bytes_per_token(
            m.stored_layers, m.hidden_size, self._torch_dtype.itemsize, m.topk, m.store_dtype, m.topk_tail
        )

    def disk_bytes(self) -> int:
        """Bytes of all files under the store root (shards, temp leftovers, metadata)."""
        return dir_bytes(self.root)
