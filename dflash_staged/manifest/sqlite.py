"""The manifest: the single source of truth shared by ``extract`` and ``train``.

A manifest is a directory (``manifests/<name>/`` by default)::

    manifest.db         SQLite database in WAL mode: tables meta, jobs, events, procs
    samples/tokens.npy  int32, every sample's token ids concatenated (after truncation)
    samples/loss_mask.npy  uint8, same length
    samples/offsets.npy    int64 [N+1]; sample i is tokens[offsets[i]:offsets[i+1]]

It is created atomically (built under a temporary name, fsynced, renamed), so it
either exists whole or not at all. **One host only**: SQLite locking is not safe
on NFS or other network filesystems; keep the manifest on a local disk of the
node that runs both extract and train. The samples are immutable after creation.

Job state machine (every transition is one ``BEGIN IMMEDIATE`` transaction)::

    pending ──claim──▶ claimed ──publish──▶ written ──consume──▶ consumed ──release──▶ released
       ▲                  │                    │                     │   └──keep (--keep-shards)──▶ kept
       │   lease expired, │                    │ shard failed        │
       ├── owner dead, ◀──┘                    │ verification        │ trainer resumed from a
       │   abandon, or                         │                     │ checkpoint not covering it
       │   error (< max)                       ▼                     ▼
       └──────────────────────────────────── pending             written
    claimed ──error, errors >= max_attempts──▶ failed (error text kept)
    consumed ──shard missing, step covered by a durable checkpoint──▶ released

- ``claimed`` records worker id, host, pid + process start time (pids are
  reused), lease deadline and attempt count. An expired lease is reclaimable;
  on the same host, a claim whose process is gone is reclaimable at once.
- ``written`` records shard bytes and checksum. A job becomes ``written`` only if
  the publishing worker's attempt still holds the claim; a worker that lost its
  claim deletes its own shard. A trainer admitting a written shard into its
  buffer sets ``taken_by``/``rank`` (the state stays ``written``).
- ``consumed`` records the trainer rank and optimizer step, set when that step
  completes. ``released`` means the shard was deleted after a durable checkpoint
  covered the step; ``kept`` means it stays on disk for replay. Neither counts
  against the window.
- The window is the number and bytes of jobs ``claimed``, ``written`` or
  ``consumed`` (claimed jobs count ``real_tokens x bytes_per_token`` bytes once
  extract has recorded ``bytes_per_token``). Checking it and claiming are one
  transaction, so concurrent workers cannot overshoot it.
- ``extract_done`` is true when no job of any epoch is ``pending`` or ``claimed``;
  any job returning to ``pending`` makes it false again.

Job ids are ``epoch * n_batches + pos``: unique across epochs, in manifest order.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from dflash_staged.config import Config, config_from_dict
from dflash_staged.manifest.build import (FORMAT_VERSION, ONE_HOST, ManifestError, check_local_fs, diff_dicts,  # noqa: F401
                             write_manifest_dir)
from dflash_staged.procs import my_identity, pid_alive

STATES = ("pending", "claimed", "written", "consumed", "released", "kept", "failed")
IN_WINDOW = ("claimed", "written", "consumed")
class ManifestMismatchError(ManifestError):
    """An existing manifest was planned from different inputs."""


class TrainerBusyError(ManifestError):
    """Another trainer already consumes this manifest."""


@dataclass
class Job:
    id: int
    epoch: int
    pos: int
    bucket: int
    sample_ids: list[int]
    real_tokens: int
    padded_tokens: int
    state: str
    attempts: int = 0
    worker: str | None = None
    shard_bytes: int | None = None
    checksum: str | None = None
    step: int | None = None
    rank: int | None = None
    taken_by: str | None = None

    @classmethod
    def from_row(cls, r: sqlite3.Row) -> "Job":
        return cls(id=r["id"], epoch=r["epoch"], pos=r["pos"], bucket=r["bucket"],
                   sample_ids=json.loads(r["sample_ids"]), real_tokens=r["real_tokens"],
                   padded_tokens=r["padded_tokens"], state=r["state"], attempts=r["attempts"],
                   worker=r["worker"], shard_bytes=r["shard_bytes"], checksum=r["checksum"],
                   step=r["step"], rank=r["rank"], taken_by=r["taken_by"])


@dataclass
class ClaimResult:
    job: Job | None
    window_full: bool = False
    window: dict | None = None
    nothing_left: bool = False


class Manifest:
    """Handle on a manifest directory. Open one per process; not shared across threads."""

    def __init__(self, dir: Path, conn: sqlite3.Connection, readonly: bool):
        self.dir = Path(dir)
        self.conn = conn
        self.readonly = readonly
        self._meta: dict[str, Any] | None = None
        self._samples: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    # ------------------------------------------------------------------ creation / opening
    @classmethod
    def create(cls, dir: str | Path, *, config: Config, samples, plan, data_path: str, data_hash: str,
               layer_ids: list[int] | None = None, extra_meta: dict | None = None) -> "Manifest":
        """Create the manifest atomically; a no-op if it exists with the same inputs.

        Raises ManifestMismatchError naming the differences if it exists with other inputs.
        """
        dir = Path(dir)
        wanted = {"config": config.to_dict(), "data_hash": data_hash, "epochs": plan.epochs, "seed": plan.seed}
        if dir.is_dir() and not any(dir.iterdir()):
            dir.rmdir()  # an empty directory (e.g. made by the user) counts as no manifest
        if dir.exists():
            m = cls.open(dir)
            have = {"config": m.config.to_dict(), "data_hash": m.meta["data_hash"], "epochs": m.meta["epochs"],
                    "seed": m.meta["seed"]}
            diffs = diff_dicts(have, wanted)
            if diffs:
                m.close()
                raise ManifestMismatchError(
                    f"{dir} was planned from different inputs ({'; '.join(diffs[:8])}"
                    f"{'; ...' if len(diffs) > 8 else ''}); use another --manifest directory, or delete "
                    f"{dir} to re-plan")
            return m
        write_manifest_dir(dir, config=config, samples=samples, plan=plan, data_path=data_path,
                           data_hash=data_hash, layer_ids=layer_ids, extra_meta=extra_meta)
        return cls.open(dir)

    @classmethod
    def open(cls, dir: str | Path, readonly: bool = False) -> "Manifest":
        dir = Path(dir)
        db = dir / "manifest.db"
        if not db.is_file():
            raise ManifestError(f"no manifest at {dir} (missing {db.name}); run `dflash plan --manifest {dir}` first")
        if not readonly:
            check_local_fs(dir)
        uri = f"file:{db}?mode=ro" if readonly else f"file:{db}"
        try:
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=120.0, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA busy_timeout=120000")
            if not readonly:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
            conn.execute("SELECT 1 FROM meta LIMIT 1")
        except sqlite3.DatabaseError as e:
            raise ManifestError(f"{db} cannot be opened ({e}); {ONE_HOST}") from None
        return cls(dir, conn, readonly)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Manifest":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE): all of it commits, or none of it."""
        if self.readonly:
            raise ManifestError(f"{self.dir} is open read-only")
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # ------------------------------------------------------------------ metadata and samples
    @property
    def meta(self) -> dict[str, Any]:
        if self._meta is None:
            self._meta = {r["key"]: json.loads(r["value"]) for r in self.conn.execute("SELECT key, value FROM meta")}
        return self._meta

    @property
    def config(self) -> Config:
        return config_from_dict(self.meta["config"], f"{self.dir} (config snapshot)")

    @property
    def manifest_id(self) -> str:
        return self.meta["manifest_id"]

    def set_meta(self, key: str, value: Any) -> None:
        with self.tx() as c:
            c.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))
        self._meta = None

    def _load_samples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._samples is None:
            d = self.dir / "samples"
            self._samples = (np.load(d / "tokens.npy", mmap_mode="r"), np.load(d / "loss_mask.npy", mmap_mode="r"),
                             np.load(d / "offsets.npy"))
        return self._samples

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int32) and loss mask (uint8) of sample i."""
        tokens, mask, offsets = self._load_samples()
        a, b = int(offsets[i]), int(offsets[i + 1])
        return np.asarray(tokens[a:b]), np.asarray(mask[a:b])

    def sample_lengths(self) -> np.ndarray:
        return np.diff(self._load_samples()[2])

    # ------------------------------------------------------------------ queries
    def job(self, job_id: int) -> Job:
        r = self.conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if r is None:
            raise ManifestError(f"{self.dir}: no job {job_id}")
        return Job.from_row(r)

    def jobs(self, state: str | None = None) -> list[Job]:
        q, args = "SELECT * FROM jobs", ()
        if state:
            q, args = q + " WHERE state = ?", (state,)
        return [Job.from_row(r) for r in self.conn.execute(q + " ORDER BY id", args)]

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for r in self.conn.execute("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state"):
            out[r["state"]] = r["n"]
        return out

    def window(self, conn: sqlite3.Connection | None = None) -> dict[str, int]:
        c = conn or self.conn
        r = c.execute(
            "SELECT COUNT(*) AS n, COALESCE(SUM(CASE WHEN state='claimed' THEN real_tokens * ? "
            "ELSE COALESCE(shard_bytes, 0) END), 0) AS b FROM jobs WHERE state IN ('claimed','written','consumed')",
            (int(self._bytes_per_token(c)),)).fetchone()
        return {"shards": int(r["n"]), "bytes": int(r["b"])}

    def _bytes_per_token(self, c: sqlite3.Connection) -> int:
        r = c.execute("SELECT value FROM meta WHERE key = 'bytes_per_token'").fetchone()
        return int(json.loads(r["value"])) if r else 0

    def extract_done(self) -> bool:
        r = self.conn.execute("SELECT COUNT(*) FROM jobs WHERE state IN ('pending','claimed')").fetchone()
        return r[0] == 0

    def events(self, kind: str | None = None) -> list[dict]:
        q, args = "SELECT * FROM events", ()
        if kind:
            q, args = q + " WHERE kind = ?", (kind,)
        return [dict(r) for r in self.conn.execute(q + " ORDER BY id", args)]

    def status(self) -> dict[str, Any]:
        m = self.meta
        reasons: dict[str, int] = {}
        for r in self.conn.execute("SELECT detail, COUNT(*) AS n FROM events WHERE kind='requeue' GROUP BY detail"):
            key = (r["detail"] or "").split(":", 1)[0]
            reasons[key] = reasons.get(key, 0) + r["n"]
        failed = [{"id": r["id"], "error": r["error"]} for r in
                  self.conn.execute("SELECT id, error FROM jobs WHERE state='failed' ORDER BY id")]
        return {
            "manifest": str(self.dir), "manifest_id": m["manifest_id"], "jobs": self.counts(),
            "total_jobs": sum(self.counts().values()), "epochs": int(m["epochs"]),
            "window": self.window(), "padding_waste": float(m["padding_waste"]),
            "extract_done": self.extract_done(),
            "tokens": {"real": int(m["tokens_real"]), "padded": int(m["tokens_padded"])},
            "samples": int(m["n_samples"]), "target_id": m["target_id"], "layer_ids": m["layer_ids"],
            "requeued": reasons, "failed": failed,
            "processes": [{"role": p["role"], "host": p["host"], "pid": p["pid"], "rank": p["rank"]}
                          for p in self.live_procs()],
        }

    # ------------------------------------------------------------------ extract side
    def _reclaim_stale(self, c: sqlite3.Connection, now: float) -> int:
        n = 0
        for r in c.execute("SELECT id, host, pid, pid_start, lease_until FROM jobs WHERE state = 'claimed'").fetchall():
            expired = r["lease_until"] is not None and r["lease_until"] < now
            if expired or not pid_alive(r["host"], r["pid"], r["pid_start"]):
                c.execute("UPDATE jobs SET state='pending', worker=NULL, host=NULL, pid=NULL, pid_start=NULL, "
                          "lease_until=NULL, updated=? WHERE id=?", (now, r["id"]))
                c.execute("INSERT INTO events (t, job, kind, detail) VALUES (?, ?, 'reclaim', ?)",
                          (now, r["id"], "lease expired" if expired else f"worker pid {r['pid']} is gone"))
                n += 1
        return n

    def reclaim_stale(self) -> int:
        with self.tx() as c:
            return self._reclaim_stale(c, time.time())

    def claim(self, worker: str, *, window: int, window_bytes: int = 0, lease_s: float = 300.0) -> ClaimResult:
        """Atomically check the window and claim the next pending job in manifest order."""
        host, pid, start = my_identity()
        now = time.time()
        with self.tx() as c:
            self._reclaim_stale(c, now)
            w = self.window(c)
            row = c.execute("SELECT * FROM jobs WHERE state = 'pending' ORDER BY epoch, pos LIMIT 1").fetchone()
            if row is None:
                left = c.execute("SELECT COUNT(*) FROM jobs WHERE state='claimed'").fetchone()[0]
                return ClaimResult(None, window=w, nothing_left=left == 0)
            if w["shards"] >= window or (window_bytes and w["bytes"] >= window_bytes):
                return ClaimResult(None, window_full=True, window=w)
            c.execute("UPDATE jobs SET state='claimed', worker=?, host=?, pid=?, pid_start=?, lease_until=?, "
                      "attempts=attempts+1, updated=? WHERE id=?",
                      (worker, host, pid, start, now + lease_s, now, row["id"]))
            job = Job.from_row(c.execute("SELECT * FROM jobs WHERE id=?", (row["id"],)).fetchone())
        return ClaimResult(job, window=w)

    def _owned(self, c: sqlite3.Connection, job: Job) -> bool:
        r = c.execute("SELECT state, worker, attempts FROM jobs WHERE id=?", (job.id,)).fetchone()
        return r is not None and r["state"] == "claimed" and r["worker"] == job.worker \
            and r["attempts"] == job.attempts

    def extend_lease(self, job: Job, lease_s: float) -> bool:
        """Extend the lease; False means the claim was lost (stop and delete any shard)."""
        with self.tx() as c:
            if not self._owned(c, job):
                return False
            c.execute("UPDATE jobs SET lease_until=? WHERE id=?", (time.time() + lease_s, job.id))
            return True

    def mark_written(self, job: Job, nbytes: int, checksum: str) -> bool:
        """Publish: claimed -> written, only if this attempt still holds the claim."""
        with self.tx() as c:
            if not self._owned(c, job):
                return False
            seq = c.execute("SELECT COALESCE(MAX(written_seq), 0) + 1 FROM jobs").fetchone()[0]
            c.execute("UPDATE jobs SET state='written', shard_bytes=?, checksum=?, written_seq=?, lease_until=NULL, "
                      "taken_by=NULL, rank=NULL, step=NULL, error=NULL, updated=? WHERE id=?",
                      (int(nbytes), checksum, seq, time.time(), job.id))
            return True

    def abandon(self, job: Job, reason: str = "abandoned") -> bool:
        """Give a claim back (signal, shutdown): claimed -> pending, not counted as an error."""
        with self.tx() as c:
            if not self._owned(c, job):
                return False
            c.execute("UPDATE jobs SET state='pending', worker=NULL, host=NULL, pid=NULL, pid_start=NULL, "
                      "lease_until=NULL, updated=? WHERE id=?", (time.time(), job.id))
            c.execute("INSERT INTO events (t, job, kind, detail) VALUES (?, ?, 'abandon', ?)",
                      (time.time(), job.id, reason))
            return True

    def fail(self, job: Job, error: str, max_attempts: int) -> str | None:
        """Record an error: back to pending, or `failed` once errors reach max_attempts."""
        with self.tx() as c:
            if not self._owned(c, job):
                return None
            r = c.execute("SELECT errors FROM jobs WHERE id=?", (job.id,)).fetchone()
            state = "failed" if r["errors"] + 1 >= max_attempts else "pending"
            c.execute("UPDATE jobs SET state=?, errors=errors+1, error=?, worker=NULL, host=NULL, pid=NULL, "
                      "pid_start=NULL, lease_until=NULL, updated=? WHERE id=?", (state, error[:2000], time.time(), job.id))
            c.execute("INSERT INTO events (t, job, kind, detail) VALUES (?, ?, 'error', ?)",
                      (time.time(), job.id, error[:2000]))
            return state

    def retry_failed(self) -> int:
        """failed -> pending with errors reset (a rerun of extract gives failed jobs a new chance)."""
        with self.tx() as c:
            return c.execute("UPDATE jobs SET state='pending', errors=0, updated=? WHERE state='failed'",
                             (time.time(),)).rowcount

    # ------------------------------------------------------------------ train side
    def take(self, trainer: str, rank: int, n: int) -> list[Job]:
        """Admit up to n written shards, oldest first, marking them taken by (trainer, rank)."""
        with self.tx() as c:
            rows = c.execute("SELECT id FROM jobs WHERE state='written' AND taken_by IS NULL "
                             "ORDER BY written_seq LIMIT ?", (n,)).fetchall()
            ids = [r["id"] for r in rows]
            c.executemany("UPDATE jobs SET taken_by=?, rank=? WHERE id=?", [(trainer, rank, i) for i in ids])
            return [Job.from_row(r) for r in c.execute(
                f"SELECT * FROM jobs WHERE id IN ({','.join('?' * len(ids))}) ORDER BY written_seq", ids)] if ids else []

    def untake(self, job_ids: Iterable[int]) -> None:
        with self.tx() as c:
            c.executemany("UPDATE jobs SET taken_by=NULL, rank=NULL WHERE id=? AND state='written'",
                          [(i,) for i in job_ids])

    def ready_count(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM jobs WHERE state='written' AND taken_by IS NULL").fetchone()[0]

    def consume(self, job_ids: Iterable[int], step: int, rank_of: dict[int, int] | None = None) -> None:
        """The optimizer step `step` completed using these shards: written -> consumed."""
        now = time.time()
        with self.tx() as c:
            for i in job_ids:
                c.execute("UPDATE jobs SET state='consumed', step=?, rank=COALESCE(?, rank), updated=? "
                          "WHERE id=? AND state='written'", (step, (rank_of or {}).get(i), now, i))

    def release(self, job_ids: Iterable[int], keep: bool = False) -> None:
        """A durable checkpoint covers these consumed jobs: -> released (shard deleted) or kept."""
        state = "kept" if keep else "released"
        with self.tx() as c:
            c.executemany(f"UPDATE jobs SET state='{state}', taken_by=NULL, updated=? WHERE id=? AND state='consumed'",
                          [(time.time(), i) for i in job_ids])

    def requeue(self, job_id: int, reason: str) -> bool:
        """A shard failed verification: written/consumed -> pending for re-extraction (reason counted)."""
        with self.tx() as c:
            n = c.execute("UPDATE jobs SET state='pending', shard_bytes=NULL, checksum=NULL, written_seq=NULL, "
                          "taken_by=NULL, rank=NULL, step=NULL, worker=NULL, updated=? "
                          "WHERE id=? AND state IN ('written','consumed')", (time.time(), job_id)).rowcount
            if n:
                c.execute("INSERT INTO events (t, job, kind, detail) VALUES (?, ?, 'requeue', ?)",
                          (time.time(), job_id, reason[:2000]))
            return bool(n)

    def mark_released_missing(self, job_id: int) -> None:
        """consumed job, covered by a durable checkpoint, whose shard is already gone -> released."""
        with self.tx() as c:
            c.execute("UPDATE jobs SET state='released', taken_by=NULL, updated=? WHERE id=? AND state='consumed'",
                      (time.time(), job_id))

    def resume_trainer(self, covered: dict[int, int]) -> list[int]:
        """Reconcile with a checkpoint: `covered` maps job id -> the step that consumed it.

        In one transaction: covered jobs become consumed (unless already released/kept), every
        other consumed job returns to written, and every taken mark is cleared. Returns the
        covered jobs now in state consumed (their shards are to be deleted or kept, then released).
        """
        now = time.time()
        with self.tx() as c:
            c.execute("CREATE TEMP TABLE IF NOT EXISTS cov (id INTEGER PRIMARY KEY, step INTEGER)")
            c.execute("DELETE FROM cov")
            c.executemany("INSERT INTO cov VALUES (?, ?)", list(covered.items()))
            c.execute("UPDATE jobs SET state='written', step=NULL, updated=? WHERE state='consumed' "
                      "AND id NOT IN (SELECT id FROM cov) AND shard_bytes IS NOT NULL", (now,))
            c.execute("UPDATE jobs SET state='consumed', step=(SELECT step FROM cov WHERE cov.id = jobs.id), "
                      "updated=? WHERE id IN (SELECT id FROM cov) AND state NOT IN ('released','kept')", (now,))
            c.execute("UPDATE jobs SET taken_by=NULL WHERE taken_by IS NOT NULL")
            ids = [r[0] for r in c.execute("SELECT id FROM jobs WHERE state='consumed' ORDER BY id")]
            c.execute("DELETE FROM cov")
        return ids

    # ------------------------------------------------------------------ processes
    def register(self, role: str, *, group_id: str | None = None, rank: int | None = None,
                 info: dict | None = None, exclusive: bool = False) -> str:
        """Record this process. With exclusive=True, refuse if a live process of `role` from another
        group holds the manifest (two trainers on one manifest), naming it."""
        host, pid, start = my_identity()
        pid_key = f"{role}:{host}:{pid}:{start}"
        now = time.time()
        with self.tx() as c:
            for p in c.execute("SELECT * FROM procs WHERE role=?", (role,)).fetchall():
                if not pid_alive(p["host"], p["pid"], p["pid_start"]):
                    c.execute("DELETE FROM procs WHERE id=?", (p["id"],))
                elif exclusive and p["group_id"] != group_id and p["id"] != pid_key:
                    raise TrainerBusyError(
                        f"another {role} (host {p['host']}, pid {p['pid']}) already uses {self.dir}; stop it "
                        "first, or run both as ranks of one DDP job. " + ONE_HOST)
            c.execute("INSERT OR REPLACE INTO procs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      (pid_key, role, host, pid, start, group_id, rank, now, now, json.dumps(info or {})))
        return pid_key

    def unregister(self, proc_id: str) -> None:
        with self.tx() as c:
            c.execute("DELETE FROM procs WHERE id=?", (proc_id,))

    def live_procs(self, role: str | None = None) -> list[sqlite3.Row]:
        q, args = "SELECT * FROM procs", ()
        if role:
            q, args = q + " WHERE role=?", (role,)
        return [p for p in self.conn.execute(q, args).fetchall() if pid_alive(p["host"], p["pid"], p["pid_start"])]

    def ever_registered(self, role: str) -> bool:
        return self.conn.execute("SELECT COUNT(*) FROM events WHERE kind=?", (f"start:{role}",)).fetchone()[0] > 0

    def log_event(self, kind: str, detail: str = "", job: int | None = None) -> None:
        with self.tx() as c:
            c.execute("INSERT INTO events (t, job, kind, detail) VALUES (?, ?, ?, ?)", (time.time(), job, kind, detail))
