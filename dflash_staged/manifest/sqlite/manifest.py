"""The SQLite manifest: the embedded backend for one host.

A manifest is a directory (``dflash plan --manifest DIR``)::

    manifest.db            SQLite database in WAL mode: tables meta, jobs, events, procs
    samples/tokens.npy     int32, every sample's token ids concatenated (after truncation)
    samples/loss_mask.npy  uint8, same length
    samples/offsets.npy    int64 [N+1]; sample i is tokens[offsets[i]:offsets[i+1]]

It is created atomically (:mod:`dflash_staged.manifest.build`), so it exists whole or not at
all; the samples are immutable after creation. Every state transition of
:mod:`dflash_staged.manifest.states` is one ``BEGIN IMMEDIATE`` transaction
(:mod:`.transitions`). **One host only**: SQLite locking is not safe on NFS or other
network filesystems; keep the manifest on a local disk of the node that runs both extract and
train.
"""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dflash_staged.manifest.base import Manifest, register_backend
from dflash_staged.manifest.build import ONE_HOST, check_local_fs, write_manifest_dir
from dflash_staged.manifest.sqlite.transitions import SqliteTransitions
from dflash_staged.manifest.states import (
    IN_WINDOW,
    Job,
    ManifestError,
    NoSuchJobError,
    Proc,
    TrainerBusyError,
    check_format_version,
    plan_it_first,
)
from dflash_staged.procs import my_identity, pid_alive

_IN = lambda states: "(" + ",".join(f"'{s}'" for s in states) + ")"  # noqa: E731


@register_backend
class SqliteManifest(SqliteTransitions, Manifest):
    """A manifest directory on a local disk; see the module docstring."""

    CATCH_ALL = True  # any path is a directory (asked after every other backend)

    def __init__(self, dir: Path, conn: sqlite3.Connection, readonly: bool):
        self.dir = Path(dir)
        self.address = str(dir)
        self._conn = conn
        self.readonly = readonly
        self._meta: dict[str, Any] | None = None
        self._samples: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    # ------------------------------------------------------------------ creation / opening
    @classmethod
    def handles(cls, address) -> bool:
        return True  # any path (asked last: CATCH_ALL)

    @classmethod
    def _dir(cls, address) -> Path:
        """The directory; a URL of a kind no backend takes is an error, never a directory named after it."""
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(address)):
            raise ManifestError(
                f"manifest address {str(address)!r}: unknown kind of URL; a manifest is a directory "
                "(SQLite, one host) or postgresql://USER@HOST:PORT/DB#NAME"
            )
        return Path(address)

    @classmethod
    def _exists(cls, address) -> bool:
        d = cls._dir(address)
        if d.is_dir() and not any(d.iterdir()):
            return False  # an empty directory (e.g. made by the user) counts as no manifest
        return d.exists()

    @classmethod
    def _write_new(cls, address, **kw) -> None:
        d = cls._dir(address)
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
        write_manifest_dir(d, **kw)

    @classmethod
    def _open(cls, address, readonly: bool) -> SqliteManifest:
        dir = cls._dir(address)
        db = dir / "manifest.db"
        if not db.is_file():
            raise ManifestError(f"no manifest at {dir} (missing {db.name}); {plan_it_first(str(dir))}")
        if not readonly:
            check_local_fs(dir)
        # A path, not a URI: '#' and '?' in a directory name must reach SQLite as they are.
        try:
            if readonly:
                conn = sqlite3.connect(
                    f"file:{_uri_path(db)}?mode=ro",
                    uri=True,
                    isolation_level=None,
                    timeout=120.0,
                    check_same_thread=False,
                )
            else:
                conn = sqlite3.connect(db, isolation_level=None, timeout=120.0, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA busy_timeout=120000")
            if not readonly:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
            row = conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()
        except sqlite3.DatabaseError as e:
            raise ManifestError(f"{db} cannot be opened ({e}); {ONE_HOST}") from None
        try:
            check_format_version(json.loads(row["value"]) if row else None, dir)
        except ManifestError:
            conn.close()
            raise
        return cls(dir, conn, readonly)

    def close(self) -> None:
        self._conn.close()

    @contextlib.contextmanager
    def _tx(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE): all of it commits, or none of it. Its commit
        fsyncs the WAL, unless not ``durable``: then a power loss (which takes this host's
        processes with it) may undo it, and the next durable commit makes it durable too; the write
        lock is not held through an fsync (claims, lease extensions: as on PostgreSQL)."""
        if self.readonly:
            raise ManifestError(f"{self.dir} is open read-only")
        if not durable:
            self._conn.execute("PRAGMA synchronous=NORMAL")
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        finally:
            if not durable:
                self._conn.execute("PRAGMA synchronous=FULL")

    def synchronous(self) -> int:
        """This handle's ``PRAGMA synchronous`` level (2 = FULL: commits fsync the WAL)."""
        return int(self._conn.execute("PRAGMA synchronous").fetchone()[0])

    @staticmethod
    def _event(c: sqlite3.Connection, job: int | None, kind: str, detail: str) -> None:
        c.execute(
            "INSERT INTO events (t, job, kind, detail) VALUES (?, ?, ?, ?)", (time.time(), job, kind, detail)
        )

    # ------------------------------------------------------------------ metadata and samples
    @property
    def meta(self) -> dict[str, Any]:
        if self._meta is None:
            self._meta = {
                r["key"]: json.loads(r["value"]) for r in self._conn.execute("SELECT key, value FROM meta")
            }
        return self._meta

    def set_meta(self, key: str, value: Any) -> None:
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))
        self._meta = None

    def _load_samples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._samples is None:
            d = self.dir / "samples"
            self._samples = (
                np.load(d / "tokens.npy", mmap_mode="r"),
                np.load(d / "loss_mask.npy", mmap_mode="r"),
                np.load(d / "offsets.npy"),
            )
        return self._samples

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, mask, offsets = self._load_samples()
        a, b = int(offsets[i]), int(offsets[i + 1])
        return np.asarray(tokens[a:b]), np.asarray(mask[a:b])

    def sample_lengths(self) -> np.ndarray:
        return np.diff(self._load_samples()[2])

    # ------------------------------------------------------------------ queries
    def job(self, job_id: int) -> Job:
        r = self._conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if r is None:
            raise NoSuchJobError(f"{self.dir}: no job {job_id}")
        return Job.from_row(r)

    def jobs(self, state: str | None = None) -> list[Job]:
        q, args = "SELECT * FROM jobs", ()
        if state:
            q, args = q + " WHERE state = ?", (state,)
        return [Job.from_row(r) for r in self._conn.execute(q + " ORDER BY id", args)]

    def _query(self, sql: str) -> list[sqlite3.Row]:
        return self._conn.execute(sql).fetchall()

    def window(self, node: str | None = None, conn: sqlite3.Connection | None = None) -> dict[str, int]:
        c = conn or self._conn
        bpt = c.execute("SELECT value FROM meta WHERE key = 'bytes_per_token'").fetchone()
        r = c.execute(
            "SELECT COUNT(*) AS n, COALESCE(SUM(CASE WHEN state='claimed' THEN real_tokens * ? "
            f"ELSE COALESCE(shard_bytes, 0) END), 0) AS b FROM jobs WHERE state IN {_IN(IN_WINDOW)} "
            "AND (? IS NULL OR host = ?)",
            (int(json.loads(bpt["value"])) if bpt else 0, node, node),
        ).fetchone()
        return {"shards": int(r["n"]), "bytes": int(r["b"])}

    def ready_count(self, node: str | None = None) -> int:
        return self._conn.execute(
            "SELECT COUNT(*) FROM jobs WHERE state='written' AND taken_by IS NULL "
            "AND (? IS NULL OR host = ?)",
            (node, node),
        ).fetchone()[0]

    def consumed_upto(self, step: int) -> list[Job]:
        return [
            Job.from_row(r)
            for r in self._conn.execute(
                "SELECT * FROM jobs WHERE state='consumed' AND step IS NOT NULL AND step <= ? ORDER BY id",
                (step,),
            )
        ]

    def events(self, kind: str | None = None) -> list[dict]:
        q, args = "SELECT * FROM events", ()
        if kind:
            q, args = q + " WHERE kind = ?", (kind,)
        return [dict(r) for r in self._conn.execute(q + " ORDER BY id", args)]

    def requeue_reasons(self) -> dict[str, int]:
        reasons: dict[str, int] = {}
        for r in self._conn.execute(
            "SELECT detail, COUNT(*) AS n FROM events WHERE kind='requeue' GROUP BY detail"
        ):
            key = (r["detail"] or "").split(":", 1)[0]
            reasons[key] = reasons.get(key, 0) + r["n"]
        return reasons

    def failed_errors(self) -> list[tuple[Job, str]]:
        return [
            (Job.from_row(r), r["error"])
            for r in self._conn.execute("SELECT * FROM jobs WHERE state='failed' ORDER BY id")
        ]

    # ------------------------------------------------------------------ processes
    def register(
        self,
        role: str,
        *,
        group_id: str | None = None,
        rank: int | None = None,
        info: dict | None = None,
        exclusive: bool = False,
    ) -> str:
        host, pid, start = my_identity()
        pid_key = f"{role}:{host}:{pid}:{start}"
        now = time.time()
        with self._tx() as c:
            for p in c.execute("SELECT * FROM procs WHERE role=?", (role,)).fetchall():
                if not pid_alive(p["host"], p["pid"], p["pid_start"]):
                    c.execute("DELETE FROM procs WHERE id=?", (p["id"],))
                elif exclusive and p["group_id"] != group_id and p["id"] != pid_key:
                    raise TrainerBusyError(
                        f"another {role} (host {p['host']}, pid {p['pid']}) already uses {self.dir}; stop it "
                        "first, or run both as ranks of one DDP job. " + ONE_HOST
                    )
            c.execute(
                "INSERT OR REPLACE INTO procs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (pid_key, role, host, pid, start, group_id, rank, now, now, json.dumps(info or {})),
            )
            self._event(c, None, f"start:{role}", json.dumps(info or {}))
        return pid_key

    def unregister(self, proc_id: str) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM procs WHERE id=?", (proc_id,))

    def check_fence(self) -> None:
        """A no-op: one host, where a registered process that is alive is never replaced."""

    def live_procs(self, role: str | None = None) -> list[Proc]:
        q, args = "SELECT * FROM procs", ()
        if role:
            q, args = q + " WHERE role=?", (role,)
        return [
            Proc.from_row(p)
            for p in self._conn.execute(q, args).fetchall()
            if pid_alive(p["host"], p["pid"], p["pid_start"])
        ]

    def report(self, role: str, figures: dict, final: bool = False) -> None:
        host, pid, start = my_identity()
        pid_key = f"{role}:{host}:{pid}:{start}"
        # the periodic reports are figures, not state: not worth holding the write lock through an fsync
        with self._tx(durable=final) as c:
            row = c.execute("SELECT info FROM procs WHERE id=?", (pid_key,)).fetchone()
            if row is not None:
                info = {**json.loads(row["info"] or "{}"), "balance": figures}
                c.execute("UPDATE procs SET info=? WHERE id=?", (json.dumps(info), pid_key))
            if final:
                self._event(c, None, f"balance:{role}", json.dumps(figures))

    def ever_registered(self, role: str) -> bool:
        return (
            self._conn.execute("SELECT COUNT(*) FROM events WHERE kind=?", (f"start:{role}",)).fetchone()[0]
            > 0
        )

    def log_event(self, kind: str, detail: str = "", job: int | None = None) -> None:
        with self._tx() as c:
            self._event(c, job, kind, detail)


def _uri_path(p: Path) -> str:
    """``p`` percent-encoded for a ``file:`` URI ('#', '?' and '%' would otherwise end the path)."""
    from urllib.parse import quote

    return quote(str(p.resolve()))
