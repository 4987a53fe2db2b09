"""Writing a new manifest directory: schema, tokenised samples, jobs; atomically.

The directory is built with :func:`dflash_staged.fsutil.atomic_dir` (samples as .npy files, then
the SQLite database filled in one transaction and switched to WAL; every file and directory
fsynced, then renamed into place): a manifest exists whole or not at all. Leftovers of a
``plan`` killed midway are removed by the next one. :func:`plan_meta` and :func:`job_rows` are
what every backend stores. The layout and the job state machine
are specified in :mod:`dflash_staged.manifest.sqlite` and :mod:`dflash_staged.manifest.states`.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from pathlib import Path

import numpy as np

from dflash_staged.config import Config
from dflash_staged.fsutil import atomic_dir, remove_dead_temps
from dflash_staged.manifest.states import FORMAT_VERSION, ManifestError

ONE_HOST = (
    "the SQLite manifest is for one host: keep it on a local disk (not NFS) of the node "
    "that runs both extract and train"
)
_NETWORK_FS = {
    "nfs",
    "nfs4",
    "cifs",
    "smbfs",
    "smb3",
    "fuse.sshfs",
    "9p",
    "lustre",
    "gpfs",
    "glusterfs",
    "ceph",
    "fuse.glusterfs",
}


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
        if (
            len(parts) >= 3
            and (p == parts[1] or p.startswith(parts[1].rstrip("/") + "/"))
            and len(parts[1]) > len(best)
        ):
            best, fstype = parts[1], parts[2]
    if fstype in _NETWORK_FS:
        raise ManifestError(f"{path} is on a {fstype} filesystem; {ONE_HOST}")


def plan_meta(
    *,
    config: Config,
    samples,
    plan,
    data_path: str,
    data_hash: str,
    layer_ids: list[int] | None = None,
    extra_meta: dict | None = None,
) -> dict:
    """A new manifest's metadata (every backend stores these keys)."""
    return {
        "format_version": FORMAT_VERSION,
        "manifest_id": uuid.uuid4().hex,
        "created": time.time(),
        "config": config.to_dict(),
        "config_hash": config.plan_hash(),
        "data_path": str(data_path),
        "data_hash": data_hash,
        "target_id": config.target.model,
        "layer_ids": layer_ids,
        "epochs": plan.epochs,
        "seed": plan.seed,
        "n_batches": len(plan.batches),
        "n_samples": len(samples.offsets) - 1,
        "bucket_edges": list(map(int, plan.edges)),
        "padding_waste": float(plan.padding_waste),
        "tokens_real": int(plan.tokens_real),
        "tokens_padded": int(plan.tokens_padded),
        "ingest_stats": samples.stats,
        "bytes_per_token": 0,
        **(extra_meta or {}),
    }


def job_rows(plan):
    """(id, epoch, pos, bucket, sample ids, real tokens, padded tokens) of every job, in manifest order."""
    n = len(plan.batches)
    return (
        (
            j.epoch * n + j.pos,
            j.epoch,
            j.pos,
            j.bucket,
            [int(x) for x in j.sample_ids],
            int(j.real_tokens),
            int(j.padded_tokens),
        )
        for j in plan.jobs()
    )


def save_samples(dir: Path, samples) -> None:
    """The samples' arrays as ``dir/{tokens,loss_mask,offsets}.npy`` (each fsynced)."""
    dir.mkdir(parents=True, exist_ok=True)
    _save_npy(dir / "tokens.npy", np.ascontiguousarray(samples.tokens, dtype=np.int32))
    _save_npy(dir / "loss_mask.npy", np.ascontiguousarray(samples.loss_mask, dtype=np.uint8))
    _save_npy(dir / "offsets.npy", np.ascontiguousarray(samples.offsets, dtype=np.int64))


def write_manifest_dir(dir: Path, **plan_kw) -> None:
    """Build the SQLite manifest directory ``dir`` (which must not exist) atomically."""
    dir.parent.mkdir(parents=True, exist_ok=True)
    check_local_fs(dir.parent)
    remove_dead_temps(dir)  # left by a `plan` killed midway
    with atomic_dir(dir) as tmp:
        save_samples(tmp / "samples", plan_kw["samples"])
        conn = sqlite3.connect(tmp / "manifest.db", isolation_level=None)
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.executescript(_SCHEMA)
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in plan_meta(**plan_kw).items()]
        )
        conn.executemany(
            "INSERT INTO jobs (id, epoch, pos, bucket, sample_ids, real_tokens, padded_tokens) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            ((r[0], r[1], r[2], r[3], json.dumps(r[4]), r[5], r[6]) for r in job_rows(plan_kw["plan"])),
        )
        conn.execute("COMMIT")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.close()
