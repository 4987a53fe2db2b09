"""The hidden-state shard store: zarr v3 groups written by ``extract``, read and deleted by ``train``.

This docstring is the one place the on-disk layout is specified.

Layout (all metadata is standard zarr v3 ``zarr.json``)::

    STORE/zarr.json                  group; attributes["dflash_store"] = {format_version,
                                     manifest_id, target_id, layer_ids, hidden_size,
                                     logical_dtype, compression, last_layer, topk,
                                     topk_temperature, topk_tail, store_dtype}
    STORE/shards/zarr.json           group
    STORE/shards/e{E}/zarr.json      group, one per epoch
    STORE/shards/e{E}/j{J}/          group, one per job (a "shard"); attributes["dflash_shard"] =
                                     {format_version, epoch, job_id, num_tokens, num_samples,
                                     logical_dtype, [store_dtype,] compression, nbytes, checksum,
                                     arrays: {name: {shape, dtype, file, stored_bytes, raw_bytes, xxh3}}}
        hidden/       [T, K, H]  the K stored layers' hidden states, samples packed back to back
        input_ids/    [T] int32
        loss_mask/    [T] uint8 (0/1)
        cu_seqlens/   [B+1] int64, sample b is tokens cu_seqlens[b]:cu_seqlens[b+1]
        sample_ids/   [B] int64 (ids of the plan's samples)
        topk_ids/     [T, k] int32, only when topk > 0: the target's k most likely next tokens
                      after each token, most likely first
        topk_logprobs/ [T, k] float16: their log-probabilities at topk_temperature (over the whole
                      vocabulary, from the target's last layer, final norm and head)
        topk_logtail/ [T] float32, when topk_tail: the log of the probability mass outside the k
                      (-inf when k covers the vocabulary), computed from the logits in log space
        hidden_scale/ [T, K] float32, only when store_dtype is "float8_e4m3fn": each stored state's
                      scale; hidden then holds e4m3 values, the state being hidden x scale

T is the number of real tokens (no padding), H = hidden_size, K = len(layer_ids): the tapped
layers' outputs in ``layer_ids`` order, plus one when ``last_layer`` is set (the target's
``[target] store_last_layer``): then ``hidden[:, K-1]`` is the output of decoder layer
``last_layer`` (the last one), before the target's final norm. A store without the key (written
before it existed) reads as ``last_layer = null``, one without ``topk`` as ``topk = 0``, and one
without ``topk_tail`` as ``false`` (its shards have no ``topk_logtail``; the trainer then derives the
tail from the fp16 entries and says so). Each array
is a single chunk (chunk shape = shape, or 1 where a dimension is 0) stored in the file
``<array>/c.0[.0.0]`` (default chunk key encoding, separator "."), codecs ``bytes`` (little
endian) and, if the store's compression is "zstd", ``zstd`` level 1. ``hidden`` is stored as
``uint16`` holding bfloat16 bit patterns when logical_dtype is "bfloat16" (zarr 3.1 has no
bfloat16), natively for "float16"/"float32"; every array carries the attribute
``logical_dtype``. Reading it back gives a tensor bit-identical to the one written. In a store
with ``store_dtype = "float8_e4m3fn"`` (written ``[extract] store_dtype``; a store without the
key is ``"target"``: the hidden array in ``logical_dtype``) ``hidden`` is ``uint8`` holding e4m3
bit patterns (attribute ``logical_dtype`` "float8_e4m3fn"), quantised as
:mod:`dflash_staged.store.fp8` specifies, and the shard's attributes carry ``store_dtype``; it reads
back as float8_e4m3fn with its ``hidden_scale``, the bytes as written. A store holds one precision.

Integrity: ``arrays[name].xxh3`` is the XXH3-64 digest (16 hex digits) of the array's raw
(uncompressed) little-endian bytes; ``checksum`` = ``"xxh3_64:"`` + the XXH3-64 digest of the
array digests as 8-byte big-endian values, concatenated in the order hidden, input_ids,
loss_mask, cu_seqlens, sample_ids (then topk_ids, topk_logprobs[, topk_logtail] when stored, then
hidden_scale in FP8). ``nbytes`` is the total size of the chunk files. The manifest records (nbytes, checksum)
when it marks a job ``written``; readers pass the checksum back as ``expected_checksum`` and get
:class:`ShardCorruptError` if the shard was replaced. A missing shard raises
:class:`ShardMissingError`, a short file :class:`ShardTruncatedError`, a digest mismatch
:class:`ShardCorruptError`; the manifest then sends the job back to ``pending`` (never silently
skipped or replaced).

Atomicity: a shard is written in ``shards/e{E}/.tmp~j{J}~{pid}~{token}~{host}``, every file and
directory fsynced, then renamed to ``j{J}`` and the epoch directory fsynced; a reader sees a
complete shard or none (``write_shard`` = ``stage_shard`` + ``commit_staged``; extract may do
the two steps separately, committing under the manifest's lock). Deletion renames to
``.del~...`` first. The store itself is created in
``.{name}.tmp~...`` next to it and renamed into place. Leftovers of dead writers (pid not alive
on this host) are removed by :meth:`ShardStore.cleanup_temp`, which ``create_or_open`` runs; on a
store shared by several hosts, another host's leftovers go once the manifest shows its claim lost,
and so does a shard renamed into place after its job was released or requeued (the manifest says which).

Reading one shard with plain zarr and numpy::

    import numpy as np, zarr
    g = zarr.open_group("STORE", mode="r")["shards/e0/j17"]  # attrs["dflash_shard"]
    cu, ids = g["cu_seqlens"][:], g["input_ids"][:]            # [B+1] int64, [T] int32
    h = g["hidden"][:]                                          # [T, K, H] uint16 bf16 bits
    h32 = (h.astype(np.uint32) << 16).view(np.float32)          # exact bf16 -> float32

The code follows the seams of this contract: :mod:`~dflash_staged.store.paths` (where shards
are, sizes), :mod:`~dflash_staged.store.write` (checking, staging, publishing),
:mod:`~dflash_staged.store.read` (reading and verifying; its fast path bypasses zarr's codecs),
:mod:`~dflash_staged.store.cleanup` (deletion, leftovers), this module (creating and opening the
store); :class:`ShardStore` brings them together.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from dflash_staged.store.meta import (
    FORMAT_VERSION,
    StoreFullError,
    StoreMeta,
    StoreMismatchError,
    StoreMissingError,
)
from dflash_staged.store.read import ShardReader
from dflash_staged.store.shardfiles import fsync_dir, group_json, owner_dead, temp_name, write_json
from dflash_staged.store.write import ShardWriter


class ShardStore(ShardWriter, ShardReader):
    """A directory of shards; see the module docstring for the layout contract."""

    # -- opening -------------------------------------------------------------------------------

    @staticmethod
    def exists(root: str | os.PathLike) -> bool:
        return (Path(root) / "zarr.json").is_file()

    @classmethod
    def open(cls, root: str | os.PathLike, expect: dict | None = None) -> ShardStore:
        """Open an existing store; ``expect`` holds StoreMeta fields that must match."""
        root = Path(root)
        try:
            doc = json.loads((root / "zarr.json").read_bytes())
        except FileNotFoundError:
            raise StoreMissingError(
                f"no shard store at {root} (no zarr.json): run `dflash extract` to "
                f"create it, or point to the right store directory"
            ) from None
        except ValueError as e:
            raise StoreMismatchError(
                f"{root}/zarr.json is not valid JSON ({e}): "
                f"this is not a dflash shard store; use another directory"
            ) from None
        fields = (doc.get("attributes") or {}).get("dflash_store")
        if not isinstance(fields, dict):
            raise StoreMismatchError(
                f"{root} is a zarr group but not a dflash shard store "
                f"(no 'dflash_store' attribute); use another directory"
            )
        if fields.get("format_version") != FORMAT_VERSION:
            raise StoreMismatchError(
                f"shard store {root} has format_version {fields.get('format_version')}, "
                f"this version reads {FORMAT_VERSION}: delete it and re-extract"
            )
        try:
            meta = StoreMeta(**fields)
        except (TypeError, ValueError) as e:
            raise StoreMismatchError(
                f"shard store {root} has unreadable format metadata ({e}); delete it and re-extract"
            ) from None
        store = cls(root, meta)
        store._check(expect or {})
        return store

    @classmethod
    def create_or_open(cls, root: str | os.PathLike, meta: StoreMeta) -> ShardStore:
        """Create the store atomically (temp dir + rename), or open it and check it matches ``meta``."""
        root = Path(root)
        parent = root.parent
        parent.mkdir(parents=True, exist_ok=True)
        for entry in parent.glob(f".{root.name}.tmp~*"):  # dead creators' leftovers
            if owner_dead(entry.name, 86400.0, entry):
                shutil.rmtree(entry, ignore_errors=True)
        if not cls.exists(root):
            if root.exists() and any(root.iterdir()) and not cls.exists(root):  # (not: a racing creator won)
                raise StoreMismatchError(
                    f"{root} exists and is not empty but holds no shard store "
                    f"(no zarr.json): choose an empty or new directory"
                )
            tmp = parent / f".{root.name}{temp_name('tmp', 'store')}"
            try:
                (tmp / "shards").mkdir(parents=True)
                write_json(tmp / "shards" / "zarr.json", group_json())
                write_json(tmp / "zarr.json", group_json({"dflash_store": asdict(meta)}))
                fsync_dir(tmp / "shards")
                fsync_dir(tmp)
                try:
                    os.rename(tmp, root)  # replaces an empty dir; fails if another creator won
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                fsync_dir(parent)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise StoreFullError(
                        f"no space left on the disk of shard store {root} while creating it "
                        f"(a few KiB needed, then the shards): free space first"
                    ) from None
                raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        store = cls.open(root, expect=asdict(meta))
        store.cleanup_temp()
        return store

    def _check(self, expect: dict) -> None:
        have = asdict(self.meta)
        for key, want in expect.items():
            if key not in have:
                raise ValueError(f"unknown store field {key!r}; known: {sorted(have)}")
            if key == "layer_ids":
                want = [int(i) for i in want]
            if have[key] != want:
                raise StoreMismatchError(
                    f"shard store {self.root} was written with {key}={have[key]!r}, but this run has "
                    f"{key}={want!r}: use a fresh store directory (or delete this one) to re-extract"
                )
