"""Removing shards from the store: one shard at a time, and the leftovers of dead writers.

A deletion renames the shard to ``.del~...`` first (so a reader sees the whole shard or none),
fsyncs the epoch directory, then removes the files. :meth:`ShardCleanup.cleanup_temp` removes
the temp and deletion entries whose owner is gone (layout and naming:
:mod:`dflash_staged.store.shard_store`).
"""

from __future__ import annotations

import os
import shutil

from dflash_staged.store.paths import StorePaths
from dflash_staged.store.shardfiles import fsync_dir, owner_dead, temp_name


class ShardCleanup(StorePaths):
    """Deleting shards and the temp leftovers of dead writers."""

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
        """Remove temp/deletion leftovers whose writer is dead (this host) or older than ``stale_s``
        (other hosts). With ``claimed(job_id, host, pid)`` (whether that process still holds the job's
        claim: the manifest knows), another host's deletion leftovers, and its staged shards whose
        claim it lost, go at once.
        With ``unwanted(job_id)`` (whether no shard of that job should exist: the manifest knows),
        published shards of such jobs are deleted (:meth:`delete_shard`); a count of all that went."""

        def orphan(kind: str, label: str, host: str, pid: int) -> bool:
            if claimed is None:
                return False
            if kind == "del":
                return True  # a deletion renames first: what is left is never needed again
            return (
                kind == "tmp"
                and label[:1] == "j"
                and label[1:].isdigit()
                and not claimed(int(label[1:]), host, pid)
            )

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
