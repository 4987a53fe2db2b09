"""Reading shards back: the shard's metadata, then every array, each digest checked on the way.

The fast path bypasses zarr's codec pipeline: it reads the group's ``zarr.json`` and then each
chunk file straight into a preallocated torch tensor (one copy), 1 MiB at a time, taking each
block's digest while it is still in the CPU cache (:func:`dflash_staged.store.shardfiles.read_chunk`).
The layout and the errors a damaged shard raises are specified in
:mod:`dflash_staged.store.shard_store`.
"""

from __future__ import annotations

import json

import torch

from dflash_staged.store.meta import (
    SMALL_ARRAYS,
    Shard,
    ShardCorruptError,
    ShardMissingError,
    ShardTruncatedError,
)
from dflash_staged.store.paths import StorePaths
from dflash_staged.store.shardfiles import ChunkError, bytes_view, empty_tensor, prefetch, read_chunk


class ShardReader(StorePaths):
    """Reading shards: their attributes alone, or all their arrays into CPU tensors."""

    def read_attrs(self, epoch: int, job_id: int) -> dict:
        """The shard's ``dflash_shard`` attributes (sizes, checksum) without reading the data."""
        d = self.shard_path(epoch, job_id)
        try:
            doc = json.loads((d / "zarr.json").read_bytes())
            attrs = doc["attributes"]["dflash_shard"]
            ok = (
                (attrs["epoch"], attrs["job_id"]) == (int(epoch), int(job_id))
                and attrs["logical_dtype"] == self.meta.logical_dtype
                and attrs.get("store_dtype", "target") == self.meta.store_dtype
                and set(attrs["arrays"]) == set(self.meta.arrays)
            )
        except FileNotFoundError:
            if d.is_dir():
                raise ShardCorruptError(
                    f"shard {d} has no zarr.json: it is damaged; re-extract the job"
                ) from None
            raise ShardMissingError(f"shard {d} does not exist: re-extract the job") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ShardCorruptError(
                f"shard {d}/zarr.json is unreadable ({e!r}): re-extract the job"
            ) from None
        if not ok:
            raise ShardCorruptError(
                f"shard {d} holds another job, dtype or precision than its path and store say: "
                "re-extract the job"
            )
        return attrs

    def read_shard(
        self, epoch: int, job_id: int, expected_checksum: str | None = None, verify: bool = True
    ) -> Shard:
        """Read one shard into CPU tensors; with ``verify`` check every array's digest."""
        d = self.shard_path(epoch, job_id)
        attrs = self.read_attrs(epoch, job_id)
        if expected_checksum is not None and attrs["checksum"] != expected_checksum:
            raise ShardCorruptError(
                f"shard {d} has checksum {attrs['checksum']} but the manifest recorded "
                f"{expected_checksum}: it is not the shard that was written; re-extract"
            )
        out: dict[str, torch.Tensor] = {}
        names = self.meta.arrays
        for name in names[1:]:  # start the small files' reads now, so they overlap the big one
            prefetch(d / attrs["arrays"][name]["file"])
        for name in names:
            e = attrs["arrays"][name]
            dtype = self.meta.hidden_dtype if name == "hidden" else SMALL_ARRAYS[name][0]
            t = empty_tensor(e["shape"], dtype)
            view = bytes_view(t)
            if view.size != e["raw_bytes"]:
                raise ShardCorruptError(f"shard {d}: {name} metadata is inconsistent; re-extract the job")
            try:
                got = read_chunk(d / e["file"], view, e["stored_bytes"], verify, attrs["compression"])
            except ChunkError as err:
                cls = ShardTruncatedError if err.truncated else ShardCorruptError
                raise cls(f"shard file {d / e['file']}: {err}; re-extract the job") from None
            if verify and got != e["xxh3"]:
                raise ShardCorruptError(
                    f"shard {d}: {name} fails its checksum (stored xxh3 {e['xxh3']}, "
                    f"read {got}): the data is corrupt; re-extract the job"
                )
            out[name] = t
        return Shard(
            int(epoch),
            int(job_id),
            out["hidden"],
            out["input_ids"],
            out["loss_mask"].view(torch.bool),
            out["cu_seqlens"],
            out["sample_ids"],
            int(attrs["nbytes"]),
            out.get("topk_ids"),
            out.get("topk_logprobs"),
            hidden_scale=out.get("hidden_scale"),
            topk_logtail=out.get("topk_logtail"),
        )
