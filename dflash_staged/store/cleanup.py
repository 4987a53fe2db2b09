"""Removing shards from the store, and the leftovers of dead writers.

A deletion renames the shards to ``.del~...`` first (so a reader sees a whole shard or none),
fsyncs each epoch directory once, then removes the files (here, or on a :class:`Remover`'s
thread). :meth:`ShardCleanup.cleanup_temp` removes the temp and deletion entries whose owner is
gone (layout and naming: :mod:`dflash_staged.store.shard_store`).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from dflash_staged.store.paths import StorePaths
from dflash_staged.store.shardfiles import fsync_dir, owner_dead, temp_name


def _remove(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


class Remover:
    """Deletes renamed-away shards' files on a background thread (freeing a large file's blocks is
    the slow part of a deletion), one batch at a time: :meth:`remove` first waits for the previous
    batch. :meth:`done` says whether the last batch's files are gone: the trainer's ledger releases
    a batch in the manifest (which frees extract's window) only then, so the store never holds more
    than the window counts. :meth:`wait` before exit; deletion leftovers of a process that died first
    go with :meth:`ShardCleanup.cleanup_temp`."""

    def __init__(self):
        self._thread: threading.Thread | None = None

    def remove(self, paths: list[Path]) -> None:
        self.wait()
        if paths:
            self._thread = threading.Thread(target=_remove, args=(paths,), name="shard-remover", daemon=True)
            self._thread.start()

    def done(self) -> bool:
        """Whether every batch given so far is deleted."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class ShardCleanup(StorePaths):
    """Deleting shards and the temp leftovers of dead writers."""

    def delete_shard(self, epoch: int, job_id: int) -> None:
        """Remove the shard (idempotent): :meth:`delete_shards` of one."""
        self.delete_shards([(epoch, job_id)])

    def delete_shards(self, keys, remover: Remover | None = None) -> None:
        """Remove these ``(epoch, job_id)`` shards (idempotent): rename each away and fsync each epoch
        directory once (from here on no reader sees them), then delete the files, here or on
        ``remover``'s thread. A crash leaves whole shards or deletion leftovers."""
        gone, dirs = [], set()
        for epoch, job_id in keys:
            d = self.shard_path(epoch, job_id)
            away = d.parent / temp_name("del", d.name)
            try:
                os.rename(d, away)
            except FileNotFoundError:
                continue
            gone.append(away)
            dirs.add(d.parent)
        for d in dirs:
            fsync_dir(d)
        if remover is None:
            _remove(gone)
        else:
            remover.remove(gone)

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
