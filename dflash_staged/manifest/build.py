"""Writing a new manifest directory: schema, tokenised samples, jobs; atomically.

The directory is built under ``.<name>.tmp-<pid>-<rand>`` next to its final place (samples as
.npy files, then the SQLite database filled in one transaction and switched to WAL), every file
and directory fsynced, then renamed into place: a manifest exists whole or not at all. Leftovers
of a ``plan`` killed midway are removed by the next one. The layout and the job state machine
are specified in :mod:`dflash_staged.manifest`.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from dflash_staged.config import Config
from dflash_staged.errors import DflashError
from dflash_staged.fsutil import fsync_dir, fsync_path
from dflash_staged.procs import HOST, pid_alive

FORMAT_VERSION = 1
ONE_HOST = ("the SQLite manifest is for one host: keep it on a local disk (not NFS) of the node "
            "that runs both extract and train")
_NETWORK_FS = {"nfs", "nfs4", "cifs", "smbfs", "smb3", "fuse.sshfs", "9p", "lustre", "gpfs", "glusterfs",
               "ceph", "fuse.glusterfs"}


class ManifestError(DflashError):
    """The manifest is missing, inconsistent or refuses an operation."""


_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE jobs (
  id INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, pos INTEGER NOT NULL, bucket INTEGER NOT NULL,
  sample_ids TEXT NOT NULL, real_tokens INTEGER NOT NULL, padded_tokens INTEGER NOT NULL,
  state TEXT NOT NULL DEFAULT 'pending',
  worker TEXT, host TEXT, pid INTEGER, pid_start INTEGER, lease_until REAL,
  attempts INTEGER NOT NULL DEFAULT 0, errors INTEGER NOT NULL DEFAULT 0, error TEXT,
  shard_bytes INTEGER, checksum TEXT, written_seq INTEGER,
  taken_by TEXT, rank INTEGER, step INTEGER, updated REAL);
CREATE INDEX jobs_state ON jobs(state, epoch, pos);
CREATE TABLE events (id INTEGER PRIMARY KEY, t REAL NOT NULL, job INTEGER, kind TEXT NOT NULL, detail TEXT);
CREATE TABLE procs (
  id TEXT PRIMARY KEY, role TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL, pid_start INTEGER,
  group_id TEXT, rank INTEGER, started REAL, heartbeat REAL, info TEXT);
"""


def _save_npy(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())


def check_local_fs(path: Path) -> None:
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return
    best, fstype = "", ""
    p = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3 and (p == parts[1] or p.startswith(parts[1].rstrip("/") + "/")) \
                and len(parts[1]) > len(best):
            best, fstype = parts[1], parts[2]
    if fstype in _NETWORK_FS:
        raise ManifestError(f"{path} is on a {fstype} filesystem; {ONE_HOST}")


def diff_dicts(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += diff_dicts(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} -> {b!r}"]


def write_manifest_dir(dir: Path, *, config: Config, samples, plan, data_path: str, data_hash: str,
                       layer_ids: list[int] | None = None, extra_meta: dict | None = None) -> None:
    """Build the manifest directory `dir` (which must not exist) atomically."""
    dir.parent.mkdir(parents=True, exist_ok=True)
    check_local_fs(dir.parent)
    for old in dir.parent.glob(f".{dir.name}.tmp-*"):  # left by a `plan` killed midway
        pid = old.name[len(dir.name) + 6:].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(HOST, int(pid), None):
            shutil.rmtree(old, ignore_errors=True)
    tmp = dir.parent / f".{dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        (tmp / "samples").mkdir(parents=True)
        _save_npy(tmp / "samples" / "tokens.npy", np.ascontiguousarray(samples.tokens, dtype=np.int32))
        _save_npy(tmp / "samples" / "loss_mask.npy", np.ascontiguousarray(samples.loss_mask, dtype=np.uint8))
        _save_npy(tmp / "samples" / "offsets.npy", np.ascontiguousarray(samples.offsets, dtype=np.int64))
        fsync_dir(tmp / "samples")
        conn = sqlite3.connect(tmp / "manifest.db", isolation_level=None)
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.executescript(_SCHEMA)
        n_batches = len(plan.batches)
        meta = {
            "format_version": FORMAT_VERSION, "manifest_id": uuid.uuid4().hex, "created": time.time(),
            "config": config.to_dict(), "config_hash": config.plan_hash(), "data_path": str(data_path),
            "data_hash": data_hash, "target_id": config.target.model, "layer_ids": layer_ids,
            "epochs": plan.epochs, "seed": plan.seed, "n_batches": n_batches, "n_samples": len(samples.offsets) - 1,
            "bucket_edges": list(map(int, plan.edges)), "padding_waste": float(plan.padding_waste),
            "tokens_real": int(plan.tokens_real), "tokens_padded": int(plan.tokens_padded),
            "ingest_stats": samples.stats, "bytes_per_token": 0, **(extra_meta or {}),
        }
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()])
        conn.executemany(
            "INSERT INTO jobs (id, epoch, pos, bucket, sample_ids, real_tokens, padded_tokens) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            ((j.epoch * n_batches + j.pos, j.epoch, j.pos, j.bucket, json.dumps(list(map(int, j.sample_ids))),
              int(j.real_tokens), int(j.padded_tokens)) for j in plan.jobs()))
        conn.execute("COMMIT")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.close()
        fsync_path(tmp / "manifest.db")
        fsync_dir(tmp)
        os.rename(tmp, dir)
        fsync_dir(dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
