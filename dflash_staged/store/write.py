"""Writing shards: check the arrays, stage a shard under a temporary name, publish it by a rename.

A shard is written in ``shards/e{E}/.tmp~j{J}~...``, every file and directory fsynced, then
renamed to ``j{J}`` (:meth:`ShardWriter.commit_staged`, replacing an older shard of the same job)
and the epoch directory fsynced. The layout, the checksums and the atomicity contract are
specified in :mod:`dflash_staged.store.shard_store`.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch

from dflash_staged.store.cleanup import ShardCleanup
from dflash_staged.store.fp8 import FP8, quantize
from dflash_staged.store.meta import (
    ARRAYS,
    FORMAT_VERSION,
    SMALL_ARRAYS,
    TOPK_ARRAYS,
    TOPK_TAIL_ARRAYS,
    ShardInfo,
    StagedShard,
    StoreFullError,
)
from dflash_staged.store.shardfiles import (
    array_json,
    bytes_view,
    chunk_file,
    combine_hex,
    fsync_all,
    fsync_dir,
    group_json,
    hash_hex,
    new_hash,
    temp_name,
    write_file,
    write_json,
    zstd,
)


class ShardWriter(ShardCleanup):
    """Staging and publishing shards (publishing replaces an older shard of the job: a deletion)."""

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

    def _hidden(self, hidden, scale) -> dict[str, torch.Tensor]:
        """The hidden array (and in an FP8 store its scales): states in the logical dtype, quantized
        here in an FP8 store, or already quantized (``hidden`` float8_e4m3fn with ``scale``)."""
        k, h, fp8 = self.meta.stored_layers, self.meta.hidden_size, self.meta.fp8
        if hidden.dim() != 3 or hidden.shape[1] != k or hidden.shape[2] != h:
            raise ValueError(f"hidden has shape {tuple(hidden.shape)}; this store wants [T, {k}, {h}]")
        if hidden.dtype == FP8 and fp8:
            if scale is None or tuple(scale.shape) != tuple(hidden.shape[:2]):
                raise ValueError(f"FP8 hidden states need their scales [T, {k}]")
        elif hidden.dtype != self._torch_dtype:
            raise ValueError(f"hidden is {hidden.dtype}; this store holds {self.meta.logical_dtype}")
        elif scale is not None:
            raise ValueError("hidden_scale goes with float8_e4m3fn hidden states only")
        elif fp8:
            hidden, scale = quantize(hidden)
        out = {"hidden": hidden.detach().to("cpu").contiguous()}
        if fp8:
            out["hidden_scale"] = scale.detach().to("cpu", torch.float32).contiguous()
        return out

    def _arrays(
        self, hidden, input_ids, loss_mask, cu_seqlens, sample_ids, topk=None, hidden_scale=None
    ) -> dict[str, torch.Tensor]:
        out = self._hidden(hidden, hidden_scale)
        t = hidden.shape[0]
        for name, val in (
            ("input_ids", input_ids),
            ("loss_mask", loss_mask),
            ("cu_seqlens", cu_seqlens),
            ("sample_ids", sample_ids),
        ):
            val = torch.as_tensor(val).detach().to("cpu")
            if val.dim() != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(val.shape)}")
            out[name] = val.to(SMALL_ARRAYS[name][0]).contiguous()
        ids, cu = torch.as_tensor(input_ids), out["cu_seqlens"]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= 2**31):
            raise ValueError("input_ids must lie in [0, 2**31)")
        if out["input_ids"].shape[0] != t or out["loss_mask"].shape[0] != t:
            raise ValueError(f"input_ids/loss_mask must have T={t} entries like hidden")
        if (
            cu.shape[0] != out["sample_ids"].shape[0] + 1
            or int(cu[0]) != 0
            or int(cu[-1]) != t
            or bool((cu[1:] < cu[:-1]).any())
        ):
            raise ValueError(
                f"cu_seqlens must be non-decreasing, start at 0, end at T={t} "
                f"and have len(sample_ids)+1 entries; got {cu.tolist()[:8]}..."
            )
        if bool((out["loss_mask"] > 1).any()):
            raise ValueError("loss_mask must be 0/1")
        k = self.meta.topk
        if bool(k) != (topk is not None):
            raise ValueError(
                f"this store holds the target's top-{k} log-probabilities: give {'them' if k else 'none'}"
            )
        if k:
            names = self.meta.arrays[len(ARRAYS) : len(ARRAYS) + len(TOPK_ARRAYS) + self.meta.topk_tail]
            if len(topk) != len(names):
                raise ValueError(f"this store holds {', '.join(names)}: give {len(names)} top-k tensors")
            for name, val in zip(names, topk):
                val = torch.as_tensor(val).detach().to("cpu")
                want = (t,) if name in TOPK_TAIL_ARRAYS else (t, k)
                if tuple(val.shape) != want:
                    raise ValueError(f"{name} has shape {tuple(val.shape)}; this store wants {list(want)}")
                out[name] = val.to(SMALL_ARRAYS[name][0]).contiguous()
        if self.meta.fp8:  # the checksum's order: the store's arrays (meta.arrays)
            out["hidden_scale"] = out.pop("hidden_scale")
        return out

    def write_shard(
        self, epoch: int, job_id: int, hidden: torch.Tensor, input_ids, loss_mask, cu_seqlens, sample_ids,
        topk=None, hidden_scale=None,
    ) -> ShardInfo:  # fmt: skip
        """Publish one shard atomically (replacing an older one of the same job); return its size and
        checksum. ``topk``: the target's (ids, log-probabilities) ``[T, k]`` and the tail's log-mass ``[T]``
        (where the store keeps it), in a store that holds them.
        In an FP8 store ``hidden`` is quantized here, or comes quantized with ``hidden_scale``."""
        staged = self.stage_shard(
            epoch, job_id, hidden, input_ids, loss_mask, cu_seqlens, sample_ids, topk, hidden_scale
        )
        self.commit_staged(staged)
        return staged.info

    def commit_staged(self, staged: StagedShard) -> None:
        """Rename a staged shard into place (replacing an older one of the same job) and fsync the parent.

        Extract calls this while holding the manifest's write lock, after checking that its claim is
        still valid, so a worker that lost its claim can never replace a newer shard."""
        final = self.shard_path(staged.info.epoch, staged.info.job_id)
        if final.exists():
            self.delete_shard(staged.info.epoch, staged.info.job_id)
        os.rename(staged.tmp, final)
        fsync_dir(final.parent)

    @staticmethod
    def discard_staged(staged: StagedShard) -> None:
        shutil.rmtree(staged.tmp, ignore_errors=True)

    def stage_shard(
        self, epoch: int, job_id: int, hidden: torch.Tensor, input_ids, loss_mask, cu_seqlens, sample_ids,
        topk=None, hidden_scale=None,
    ) -> StagedShard:  # fmt: skip
        """Write one shard completely (files and directories fsynced) under a temporary name."""
        arrays = self._arrays(hidden, input_ids, loss_mask, cu_seqlens, sample_ids, topk, hidden_scale)
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
                write_json(
                    adir / "zarr.json",
                    array_json(t.shape, zdtype, comp, self._logical(name, zdtype)),
                    sync=False,
                )
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
                entries[name] = {
                    "shape": list(t.shape),
                    "dtype": zdtype,
                    "file": f"{name}/{fname}",
                    "stored_bytes": size,
                    "raw_bytes": int(view.size),
                    "xxh3": digest,
                }
            checksum = "xxh3_64:" + combine_hex(digests)
            attrs = {
                "format_version": FORMAT_VERSION,
                "epoch": int(epoch),
                "job_id": int(job_id),
                "num_tokens": int(arrays["hidden"].shape[0]),
                "num_samples": int(arrays["sample_ids"].shape[0]),
                "logical_dtype": self.meta.logical_dtype,
                **({"store_dtype": self.meta.store_dtype} if self.meta.fp8 else {}),
                "compression": comp,
                "nbytes": nbytes,
                "checksum": checksum,
                "arrays": entries,
            }
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

    def _logical(self, name: str, zdtype: str) -> str:
        """An array's ``logical_dtype`` attribute: what its bytes hold."""
        if name != "hidden":
            return zdtype
        return self.meta.store_dtype if self.meta.fp8 else self.meta.logical_dtype

    def _full_error(self, epoch: int, job_id: int, arrays: dict) -> StoreFullError:
        need = self.estimate_nbytes(int(arrays["hidden"].shape[0]), int(arrays["sample_ids"].shape[0]))
        return StoreFullError(
            f"no space left on the disk of shard store {self.root} while writing shard "
            f"e{epoch}/j{job_id} ({need} bytes needed): free space or lower extract.window"
        )
