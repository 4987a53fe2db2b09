"""The SQLite manifest's state transitions: the extract side and the train side.

:class:`SqliteTransitions` is a base of :class:`~dflash_staged.manifest.sqlite.SqliteManifest`
(the layout, the connection and the queries are there). Every transition of the state machine
(:mod:`dflash_staged.manifest.states`) is one ``BEGIN IMMEDIATE`` transaction (``_tx``), so on one
host the window check and the claim, or a publish's ownership check, its rename and its update,
happen as one. A claim is owned by one attempt of one worker of one process (host, pid and start
time: a worker id repeats on other hosts); whoever finds an expired lease, or a claim whose
process is gone, returns it to pending.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable

from dflash_staged.manifest.consume import consume_ids, consume_refused
from dflash_staged.manifest.states import ClaimResult, Job
from dflash_staged.procs import my_identity, pid_alive

# A job's claim columns, cleared (UPDATE jobs SET ... of a job leaving ``claimed``).
FREE_CLAIM = "worker=NULL, host=NULL, pid=NULL, pid_start=NULL, lease_until=NULL"


class SqliteTransitions:
    """The transitions of a :class:`~dflash_staged.manifest.sqlite.SqliteManifest`, on its ``_tx``,
    ``_event`` and ``window``; see the module docstring."""

    # ------------------------------------------------------------------ extract side
    def _reclaim_stale(self, c: sqlite3.Connection, now: float) -> int:
        n = 0
        for r in c.execute(
            "SELECT id, host, pid, pid_start, lease_until FROM jobs WHERE state = 'claimed'"
        ).fetchall():
            expired = r["lease_until"] is not None and r["lease_until"] < now
            if expired or not pid_alive(r["host"], r["pid"], r["pid_start"]):
                c.execute(
                    f"UPDATE jobs SET state='pending', {FREE_CLAIM}, updated=? WHERE id=?", (now, r["id"])
                )
                self._event(
                    c, r["id"], "reclaim", "lease expired" if expired else f"worker pid {r['pid']} is gone"
                )
                n += 1
        return n

    def reclaim_stale(self) -> int:
        with self._tx() as c:
            return self._reclaim_stale(c, time.time())

    def claim(
        self,
        worker: str,
        *,
        window: int,
        window_bytes: int = 0,
        lease_s: float = 300.0,
        node: str | None = None,
    ) -> ClaimResult:
        host, pid, start = my_identity()
        now = time.time()
        with self._tx(durable=False) as c:  # a claim lost in a power loss: its worker went too
            self._reclaim_stale(c, now)
            w = self.window(node, c)
            row = c.execute(
                "SELECT id FROM jobs WHERE state = 'pending' ORDER BY epoch, pos LIMIT 1"
            ).fetchone()
            if row is None:
                left = c.execute("SELECT COUNT(*) FROM jobs WHERE state='claimed'").fetchone()[0]
                return ClaimResult(None, window=w, nothing_left=left == 0)
            if w["shards"] >= window or (window_bytes and w["bytes"] >= window_bytes):
                return ClaimResult(None, window_full=True, window=w)
            c.execute(
                "UPDATE jobs SET state='claimed', worker=?, host=?, pid=?, pid_start=?, lease_until=?, "
                "attempts=attempts+1, updated=? WHERE id=?",
                (worker, host, pid, start, now + lease_s, now, row["id"]),
            )
            job = Job.from_row(c.execute("SELECT * FROM jobs WHERE id=?", (row["id"],)).fetchone())
        return ClaimResult(job, window=w)

    @staticmethod
    def _owned(c: sqlite3.Connection, job: Job) -> bool:
        """Whether ``job`` (as claimed) still holds its claim: the same attempt by the same worker of the
        same process (host, pid, start time: a worker id repeats on other hosts)."""
        r = c.execute(
            "SELECT state, worker, attempts, host, pid, pid_start FROM jobs WHERE id=?", (job.id,)
        ).fetchone()
        return r is not None and tuple(r) == (
            "claimed",
            job.worker,
            job.attempts,
            job.host,
            job.pid,
            job.pid_start,
        )

    def extend_lease(self, job: Job, lease_s: float) -> bool:
        with self._tx(durable=False) as c:
            if not self._owned(c, job):
                return False
            c.execute("UPDATE jobs SET lease_until=? WHERE id=?", (time.time() + lease_s, job.id))
            return True

    def publish(self, job: Job, nbytes: int, checksum: str, commit=None) -> bool:
        with self._tx() as c:
            if not self._owned(c, job):
                return False
            if commit is not None:
                commit()
            c.execute(
                "UPDATE jobs SET state='written', shard_bytes=?, checksum=?, lease_until=NULL, "
                "taken_by=NULL, rank=NULL, step=NULL, error=NULL, updated=?, "
                "written_seq=(SELECT COALESCE(MAX(written_seq), 0) + 1 FROM jobs) WHERE id=?",
                (int(nbytes), checksum, time.time(), job.id),
            )
            return True

    def give_back(self, job: Job, reason: str = "given back") -> bool:
        with self._tx() as c:
            if not self._owned(c, job):
                return False
            c.execute(
                f"UPDATE jobs SET state='pending', {FREE_CLAIM}, updated=? WHERE id=?", (time.time(), job.id)
            )
            self._event(c, job.id, "abandon", reason)
            return True

    def fail(self, job: Job, error: str, max_attempts: int) -> str | None:
        with self._tx() as c:
            if not self._owned(c, job):
                return None
            r = c.execute("SELECT errors FROM jobs WHERE id=?", (job.id,)).fetchone()
            state = "failed" if r["errors"] + 1 >= max_attempts else "pending"
            c.execute(
                f"UPDATE jobs SET state=?, errors=errors+1, error=?, {FREE_CLAIM}, updated=? WHERE id=?",
                (state, error[:2000], time.time(), job.id),
            )
            self._event(c, job.id, "error", error[:2000])
            return state

    def retry_failed(self) -> int:
        with self._tx() as c:
            return c.execute(
                "UPDATE jobs SET state='pending', errors=0, updated=? WHERE state='failed'", (time.time(),)
            ).rowcount

    # ------------------------------------------------------------------ train side
    def _jobs_in_order(self, c: sqlite3.Connection, ids: list[int]) -> dict[int, Job]:
        rows = c.execute(f"SELECT * FROM jobs WHERE id IN ({','.join('?' * len(ids))})", ids) if ids else []
        return {r["id"]: Job.from_row(r) for r in rows}

    def take(self, trainer: str, rank: int, n: int, node: str | None = None) -> list[Job]:
        with self._tx() as c:
            ids = [
                r["id"]
                for r in c.execute(
                    "SELECT id FROM jobs WHERE state='written' AND taken_by IS NULL "
                    "AND (? IS NULL OR host = ?) ORDER BY written_seq LIMIT ?",
                    (node, node, n),
                ).fetchall()
            ]
            c.executemany("UPDATE jobs SET taken_by=?, rank=? WHERE id=?", [(trainer, rank, i) for i in ids])
            got = self._jobs_in_order(c, ids)
        return [got[i] for i in ids]

    def retake(self, trainer: str, rank: int, job_ids: Iterable[int]) -> list[Job]:
        ids = [int(i) for i in job_ids]
        with self._tx() as c:
            c.executemany(
                "UPDATE jobs SET taken_by=?1, rank=?2 WHERE id=?3 AND state='written' AND "
                "(taken_by IS NULL OR (taken_by=?1 AND rank=?2))",
                [(trainer, rank, i) for i in ids],
            )
            got = self._jobs_in_order(c, ids)
        return [
            got[i]
            for i in ids
            if i in got and got[i].state == "written" and (got[i].taken_by, got[i].rank) == (trainer, rank)
        ]

    def consume(self, job_ids: Iterable[int], step: int, rank_of: dict[int, int] | None = None) -> None:
        ids, now = consume_ids(job_ids), time.time()
        # not durable: a power loss takes the trainer too, and its resume decides from its checkpoint
        with self._tx(durable=False) as c:
            bad = [
                i
                for i in ids
                if c.execute(
                    "UPDATE jobs SET state='consumed', step=?1, rank=COALESCE(?2, rank), updated=?3 "
                    "WHERE id=?4 AND state='written' AND (taken_by IS NULL OR ?2 IS NULL OR rank=?2)",
                    (step, (rank_of or {}).get(i), now, i),
                ).rowcount
                != 1
            ]
            if bad:  # all or nothing: the exception rolls the transaction back
                raise consume_refused(step, bad, self._jobs_in_order(c, bad), rank_of)

    def release(self, job_ids: Iterable[int], keep: bool = False) -> None:
        with self._tx() as c:
            c.executemany(
                "UPDATE jobs SET state=?, taken_by=NULL, updated=? WHERE id=? AND state='consumed'",
                [("kept" if keep else "released", time.time(), i) for i in job_ids],
            )

    def requeue(self, job_id: int, reason: str) -> bool:
        with self._tx() as c:
            n = c.execute(
                "UPDATE jobs SET state='pending', shard_bytes=NULL, checksum=NULL, written_seq=NULL, "
                "taken_by=NULL, rank=NULL, step=NULL, worker=NULL, updated=? "
                "WHERE id=? AND state IN ('written','consumed')",
                (time.time(), job_id),
            ).rowcount
            if n:
                self._event(c, job_id, "requeue", reason[:2000])
            return bool(n)

    def requeue_absent_nodes(self, nodes: list[str]) -> tuple[int, int]:
        now, keep = time.time(), json.dumps(sorted(set(nodes)))
        absent = "host IS NOT NULL AND host NOT IN (SELECT value FROM json_each(?))"
        with self._tx() as c:
            ids = [
                r[0] for r in c.execute(f"SELECT id FROM jobs WHERE state='written' AND {absent}", (keep,))
            ]
            c.executemany(
                "UPDATE jobs SET state='pending', shard_bytes=NULL, checksum=NULL, written_seq=NULL, "
                "taken_by=NULL, rank=NULL, step=NULL, worker=NULL, updated=? WHERE id=?",
                [(now, i) for i in ids],
            )
            for i in ids:
                self._event(c, i, "requeue", "lost node: its shard is on a node outside this trainer job")
            gone = c.execute(
                f"UPDATE jobs SET state='released', taken_by=NULL, updated=? "
                f"WHERE state='consumed' AND {absent}",
                (now, keep),
            ).rowcount
        return len(ids), gone

    def resume_trainer(self, covered: dict[int, int]) -> list[int]:
        now = time.time()
        with self._tx() as c:
            c.execute("CREATE TEMP TABLE IF NOT EXISTS cov (id INTEGER PRIMARY KEY, step INTEGER)")
            c.execute("DELETE FROM cov")
            c.executemany("INSERT INTO cov VALUES (?, ?)", list(covered.items()))
            c.execute(
                "UPDATE jobs SET state='written', step=NULL, updated=? WHERE state='consumed' "
                "AND id NOT IN (SELECT id FROM cov) AND shard_bytes IS NOT NULL",
                (now,),
            )
            c.execute(
                "UPDATE jobs SET state='consumed', step=(SELECT step FROM cov WHERE cov.id = jobs.id), "
                "updated=? WHERE id IN (SELECT id FROM cov) AND state NOT IN ('released','kept')",
                (now,),
            )
            c.execute("UPDATE jobs SET taken_by=NULL WHERE taken_by IS NOT NULL")
            ids = [r[0] for r in c.execute("SELECT id FROM jobs WHERE state='consumed' ORDER BY id")]
            c.execute("DELETE FROM cov")
        return ids
