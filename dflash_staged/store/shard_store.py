"""The hidden-state shard store: zarr v3 groups written by ``extract``, read and deleted by ``train``.

This docstring is the one place the on-disk layout is specified.

Layout (all metadata is standard zarr v3 ``zarr.json``)::

    STORE/zarr.json                  group; attributes["dflash_store"] = {format_version,
                                     manifest_id, target_id, layer_ids, hidden_size,
                                     logical_dtype, compression}
    STORE/shards/zarr.json           group
    STORE/shards/e{E}/zarr.json      group, one per epoch
    STORE/shards/e{E}/j{J}/          group, one per job (a "shard"); attributes["dflash_shard"] =
                                     {format_version, epoch, job_id, num_tokens, num_samples,
                                     logical_dtype, compression, nbytes, checksum,
                                     arrays: {name: {shape, dtype, file, stored_bytes, raw_bytes, xxh3}}}
        hidden/       [T, K, H]  the K tapped layers' hidden states, samples packed back to back
        input_ids/    [T] int32
        loss_mask/    [T] uint8 (0/1)
        cu_seqlens/   [B+1] int64, sample b is tokens cu_seqlens[b]:cu_seqlens[b+1]
        sample_ids/   [B] int64 (ids of the plan's samples)

T is the number of real tokens (no padding), K = len(layer_ids), H = hidden_size. Each array
is a single chunk (chunk shape = shape, or 1 where a dimension is 0) stored in the file
``<array>/c.0[.0.0]`` (default chunk key encoding, separator "."), codecs ``bytes`` (little
endian) and, if the store's compression is "zstd", ``zstd`` level 1. ``hidden`` is stored as
``uint16`` holding bfloat16 bit patterns when logical_dtype is "bfloat16" (zarr 3.1 has no
bfloat16), natively for "float16"/"float32"; every array carries the attribute
``logical_dtype``. Reading it back gives a tensor bit-identical to the one written.

Integrity: ``arrays[name].xxh3`` is the XXH3-64 digest (16 hex digits) of the array's raw
(uncompressed) little-endian bytes; ``checksum`` = ``"xxh3_64:"`` + the XXH3-64 digest of the
five array digests as 8-byte big-endian values, concatenated in the order hidden, input_ids,
loss_mask, cu_seqlens, sample_ids. ``nbytes`` is the total size of the chunk
files. The manifest records (nbytes, checksum) when it marks a job ``written``; readers pass the
checksum back as ``expected_checksum`` and get :class:`ShardCorruptError` if the shard was
replaced. A missing shard raises :class:`ShardMissingError`, a short file
:class:`ShardTruncatedError`, a digest mismatch :class:`ShardCorruptError`; the manifest then sends
the job back to ``pending`` (never silently skipped or replaced).

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

The fast path here bypasses zarr's codec pipeline: it reads the group's ``zarr.json`` and then
each chunk file straight into a preallocated torch tensor (one copy), 1 MiB at a time, taking
each block's digest while it is still in the CPU cache.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import torch

from dflash_staged.fsutil import dir_bytes
from dflash_staged.store.meta import (ARRAYS, FORMAT_VERSION, LOGICAL_DTYPES, SMALL_ARRAYS, Shard, ShardCorruptError,
                                      ShardInfo, ShardMissingError, ShardTruncatedError, StagedShard, StoreFullError,
                                      StoreMeta, StoreMismatchError, StoreMissingError, bytes_per_token)
from dflash_staged.store.shardfiles import (ChunkError, array_json, bytes_view, chunk_file, combine_hex, empty_tensor,
                                            fsync_all, fsync_dir, group_json, hash_hex, new_hash, owner_dead, prefetch,
                                            read_chunk, temp_name, write_file, write_json, zstd)


class ShardStore:
    """A directory of shards; see the module docstring for the layout contract."""

    def __init__(self, root: str | os.PathLike, meta: StoreMeta):
        self.root = Path(root)
        self.meta = meta
        self._torch_dtype, self._hidden_zdtype = LOGICAL_DTYPES[meta.logical_dtype]

    # -- opening -------------------------------------------------------------------------------

    @staticmethod
    def exists(root: str | os.PathLike) -> bool:
        return (Path(root) / "zarr.json").is_file()

    @classmethod
    def open(cls, root: str | os.PathLike, expect: dict | None = None) -> "ShardStore":
        """Open an existing store; ``expect`` holds StoreMeta fields that must match."""
        root = Path(root)
        try:
            doc = json.loads((root / "zarr.json").read_bytes())
        except FileNotFoundError:
            raise StoreMissingError(f"no shard store at {root} (no zarr.json): run `dflash extract` to "
                                    f"create it, or point to the right store directory") from None
        except ValueError as e:
            raise StoreMismatchError(f"{root}/zarr.json is not valid JSON ({e}): "
                                     f"this is not a dflash shard store; use another directory") from None
        fields = (doc.get("attributes") or {}).get("dflash_store")
        if not isinstance(fields, dict):
            raise StoreMismatchError(f"{root} is a zarr group but not a dflash shard store "
                                     f"(no 'dflash_store' attribute); use another directory")
        if fields.get("format_version") != FORMAT_VERSION:
            raise StoreMismatchError(f"shard store {root} has format_version {fields.get('format_version')}, "
                                     f"this version reads {FORMAT_VERSION}: delete it and re-extract")
        try:
            meta = StoreMeta(**fields)
        except (TypeError, ValueError) as e:
            raise StoreMismatchError(f"shard store {root} has unreadable format metadata ({e}); "
                                     f"delete it and re-extract") from None
        store = cls(root, meta)
        store._check(expect or {})
        return store

    @classmethod
    def create_or_open(cls, root: str | os.PathLike, meta: StoreMeta) -> "ShardStore":
        """Create the store atomically (temp dir + rename), or open it and check it matches ``meta``."""
        root = Path(root)
        parent = root.parent
        parent.mkdir(parents=True, exist_ok=True)
        for entry in parent.glob(f".{root.name}.tmp~*"):  # dead creators' leftovers
            if owner_dead(entry.name, 86400.0, entry):
                shutil.rmtree(entry, ignore_errors=True)
        if not cls.exists(root):
            if root.exists() and any(root.iterdir()) and not cls.exists(root):  # (not: a racing creator won)
                raise StoreMismatchError(f"{root} exists and is not empty but holds no shard store "
                                         f"(no zarr.json): choose an empty or new directory")
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
                    raise StoreFullError(f"no space left on the disk of shard store {root} while creating it "
                                         f"(a few KiB needed, then the shards): free space first") from None
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
                    f"{key}={want!r}: use a fresh store directory (or delete this one) to re-extract")

    # -- paths ---------------------------------------------------------------------------------

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

    def _epoch_dir(self, epoch: int) -> Path:
        edir = self.root / "shards" / f"e{int(epoch)}"
        if not (edir / "zarr.json").is_file():
            edir.mkdir(exist_ok=True)
            tmp = edir / temp_name("tmp", "zarr.json")
            try:
                write_json(tmp, group_json())
                os.replace(tmp, edir / "zarr.json")
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            fsync_dir(edir)
            fsync_dir(edir.parent)
        return edir

    def estimate_nbytes(self, num_tokens: int, num_samples: int) -> int:
        """Uncompressed chunk bytes of a shard with these sizes."""
        return num_tokens * self.bytes_per_token + (2 * num_samples + 1) * 8

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(len(self.meta.layer_ids), self.meta.hidden_size, self._torch_dtype.itemsize)

    def disk_bytes(self) -> int:
        """Bytes of all files under the store root (shards, temp leftovers, metadata)."""
        return dir_bytes(self.root)

    # -- write / read / delete -----------------------------------------------------------------

    def _arrays(self, hidden, input_ids, loss_mask, cu_seqlens, sample_ids) -> dict[str, torch.Tensor]:
        k, h = len(self.meta.layer_ids), self.meta.hidden_size
        if hidden.dim() != 3 or hidden.shape[1] != k or hidden.shape[2] != h:
            raise ValueError(f"hidden has shape {tuple(hidden.shape)}; this store wants [T, {k}, {h}]")
        if hidden.dtype != self._torch_dtype:
            raise ValueError(f"hidden is {hidden.dtype}; this store holds {self.meta.logical_dtype}")
        t = hidden.shape[0]
        out = {"hidden": hidden.detach().to("cpu").contiguous()}
        for name, val in (("input_ids", input_ids), ("loss_mask", loss_mask),
                          ("cu_seqlens", cu_seqlens), ("sample_ids", sample_ids)):
            val = torch.as_tensor(val).detach().to("cpu")
            if val.dim() != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(val.shape)}")
            out[name] = val.to(SMALL_ARRAYS[name][0]).contiguous()
        ids, cu = torch.as_tensor(input_ids), out["cu_seqlens"]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= 2**31):
            raise ValueError("input_ids must lie in [0, 2**31)")
        if out["input_ids"].shape[0] != t or out["loss_mask"].shape[0] != t:
            raise ValueError(f"input_ids/loss_mask must have T={t} entries like hidden")
        if cu.shape[0] != out["sample_ids"].shape[0] + 1 or int(cu[0]) != 0 or int(cu[-1]) != t \
                or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing, start at 0, end at T={t} "
                             f"and have len(sample_ids)+1 entries; got {cu.tolist()[:8]}...")
        if bool((out["loss_mask"] > 1).any()):
            raise ValueError("loss_mask must be 0/1")
        return out

    def write_shard(self, epoch: int, job_id: int, hidden: torch.Tensor, input_ids, loss_mask,
                    cu_seqlens, sample_ids) -> ShardInfo:
        """Publish one shard atomically (replacing an older one of the same job); return its size and checksum."""
        staged = self.stage_shard(epoch, job_id, hidden, input_ids, loss_mask, cu_seqlens, sample_ids)
        self.commit_staged(staged)
        return staged.info

    def commit_staged(self, staged: "StagedShard") -> None:
        """Rename a staged shard into place (replacing an older one of the same job) and fsync the parent.

        Extract calls this while holding the manifest's write lock, after checking that its claim is
        still valid, so a worker that lost its claim can never replace a newer shard."""
        final = self.shard_path(staged.info.epoch, staged.info.job_id)
        if final.exists():
            self.delete_shard(staged.info.epoch, staged.info.job_id)
        os.rename(staged.tmp, final)
        fsync_dir(final.parent)

    @staticmethod
    def discard_staged(staged: "StagedShard") -> None:
        shutil.rmtree(staged.tmp, ignore_errors=True)

    def stage_shard(self, epoch: int, job_id: int, hidden: torch.Tensor, input_ids, loss_mask,
                    cu_seqlens, sample_ids) -> "StagedShard":
        """Write one shard completely (files and directories fsynced) under a temporary name."""
        arrays = self._arrays(hidden, input_ids, loss_mask, cu_seqlens, sample_ids)
        try:
            edir = self._epoch_dir(epoch)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._full_error(epoch, job_id, arrays) from None
            raise
        tmp = edir / temp_name("tmp", f"j{int(job_id)}")
        comp = self.meta.compression
        try:
            tmp.mkdir()
            digests, entries, nbytes, to_sync = [], {}, 0, [tmp]
            for name, t in arrays.items():
                zdtype = self._hidden_zdtype if name == "hidden" else SMALL_ARRAYS[name][1]
                view = bytes_view(t)
                adir = tmp / name
                adir.mkdir()
                write_json(adir / "zarr.json", array_json(t.shape, zdtype, comp, self.meta.logical_dtype
                                                          if name == "hidden" else zdtype), sync=False)
                fname = chunk_file(t.dim())
                if not view.size:
                    size, digest = 0, hash_hex(view)
                elif comp == "zstd":
                    size, digest = write_file(adir / fname, zstd().encode(view), sync=False), hash_hex(view)
                else:
                    hasher = new_hash()
                    size = write_file(adir / fname, view, hasher, sync=False)
                    digest = hasher.hexdigest()
                to_sync += [adir / "zarr.json", adir] + ([adir / fname] if size else [])
                digests.append(digest)
                nbytes += size
                entries[name] = {"shape": list(t.shape), "dtype": zdtype, "file": f"{name}/{fname}",
                                 "stored_bytes": size, "raw_bytes": int(view.size), "xxh3": digest}
            checksum = "xxh3_64:" + combine_hex(digests)
            attrs = {"format_version": FORMAT_VERSION, "epoch": int(epoch), "job_id": int(job_id),
                     "num_tokens": int(arrays["hidden"].shape[0]),
                     "num_samples": int(arrays["sample_ids"].shape[0]),
                     "logical_dtype": self.meta.logical_dtype, "compression": comp,
                     "nbytes": nbytes, "checksum": checksum, "arrays": entries}
            write_json(tmp / "zarr.json", group_json({"dflash_shard": attrs}), sync=False)
            fsync_all(to_sync + [tmp / "zarr.json"])  # every file and directory durable before the rename
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._full_error(epoch, job_id, arrays) from None
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return StagedShard(tmp, ShardInfo(int(epoch), int(job_id), nbytes, checksum))

    def _full_error(self, epoch: int, job_id: int, arrays: dict) -> StoreFullError:
        need = self.estimate_nbytes(int(arrays["hidden"].shape[0]), int(arrays["sample_ids"].shape[0]))
        return StoreFullError(f"no space left on the disk of shard store {self.root} while writing shard "
                              f"e{epoch}/j{job_id} ({need} bytes needed): free space or lower extract.window")

    def read_attrs(self, epoch: int, job_id: int) -> dict:
        """The shard's ``dflash_shard`` attributes (sizes, checksum) without reading the data."""
        d = self.shard_path(epoch, job_id)
        try:
            doc = json.loads((d / "zarr.json").read_bytes())
            attrs = doc["attributes"]["dflash_shard"]
            ok = (attrs["epoch"], attrs["job_id"]) == (int(epoch), int(job_id)) \
                and attrs["logical_dtype"] == self.meta.logical_dtype and set(attrs["arrays"]) == set(ARRAYS)
        except FileNotFoundError:
            if d.is_dir():
                raise ShardCorruptError(f"shard {d} has no zarr.json: it is damaged; re-extract the job") from None
            raise ShardMissingError(f"shard {d} does not exist: re-extract the job") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ShardCorruptError(f"shard {d}/zarr.json is unreadable ({e!r}): re-extract the job") from None
        if not ok:
            raise ShardCorruptError(f"shard {d} holds another job or dtype than its path says: re-extract the job")
        return attrs

    def read_shard(self, epoch: int, job_id: int, expected_checksum: str | None = None,
                   verify: bool = True) -> Shard:
        """Read one shard into CPU tensors; with ``verify`` check every array's digest."""
        d = self.shard_path(epoch, job_id)
        attrs = self.read_attrs(epoch, job_id)
        if expected_checksum is not None and attrs["checksum"] != expected_checksum:
            raise ShardCorruptError(f"shard {d} has checksum {attrs['checksum']} but the manifest recorded "
                                    f"{expected_checksum}: it is not the shard that was written; re-extract")
        out: dict[str, torch.Tensor] = {}
        for name in ARRAYS[1:]:  # start the small files' reads now, so they overlap the big one
            prefetch(d / attrs["arrays"][name]["file"])
        for name in ARRAYS:
            e = attrs["arrays"][name]
            dtype = self._torch_dtype if name == "hidden" else SMALL_ARRAYS[name][0]
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
                raise ShardCorruptError(f"shard {d}: {name} fails its checksum (stored xxh3 {e['xxh3']}, "
                                        f"read {got}): the data is corrupt; re-extract the job")
            out[name] = t
        return Shard(int(epoch), int(job_id), out["hidden"], out["input_ids"], out["loss_mask"].view(torch.bool),
                     out["cu_seqlens"], out["sample_ids"], int(attrs["nbytes"]))

    def delete_shard(self, epoch: int, job_id: int) -> None:
        """Remove the shard (idempotent): rename it away, fsync the epoch dir, then delete the files."""
        d = self.shard_path(epoch, job_id)
        gone = d.parent / temp_name("del", d.name)
        try:
            os.rename(d, gone)
        except FileNotFoundError:
            return
        fsync_dir(d.parent)
        shutil.rmtree(gone, ignore_errors=True)

    def cleanup_temp(self, stale_s: float = 86400.0, claimed=None, unwanted=None) -> int:
        """Remove temp/deletion leftovers whose writer is dead (this host) or older than ``stale_s`` (other
        hosts). With ``claimed(job_id, host, pid)`` (whether that process still holds the job's claim: the
        manifest knows), another host's deletion leftovers, and its staged shards whose claim it lost, go at
        once.
        With ``unwanted(job_id)`` (whether no shard of that job should exist: the manifest knows), published
        shards of such jobs are deleted (:meth:`delete_shard`); a count of all that went."""
        def orphan(kind: str, label: str, host: str, pid: int) -> bool:
            if claimed is None:
                return False
            if kind == "del":
                return True  # a deletion renames first: what is left is never needed again
            return kind == "tmp" and label[:1] == "j" and label[1:].isdigit() and not claimed(int(label[1:]), host, pid)

        removed = 0
        for edir in (self.root / "shards").glob("e*"):
            for entry in edir.glob(".*~*"):
                if owner_dead(entry.name, stale_s, entry, orphan):
                    if entry.is_dir():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
                    removed += 1
        for epoch, job_id in list(self.iter_shards()) if unwanted is not None else []:
            if unwanted(job_id):
                self.delete_shard(epoch, job_id)
                removed += 1
        return removed
