"""The PostgreSQL manifest: one run across many hosts.

Chosen by the address ``postgresql://USER@HOST:PORT/DB#NAME`` (:mod:`.pg_conn`: the address,
connections, retrying a lost connection; :mod:`.pg_schema`: the layout, and why the samples live
in the database). It implements the state machine of :mod:`.states` with the same job ids and the
same ``status --json`` as the SQLite backend; what differs is how hosts share it:

- **claim** returns this host's dead processes' claims to pending, then runs the server-side
  function ``claim_next`` (:mod:`.pg_schema`) as one statement: a transaction-scoped advisory lock
  on the manifest's window (``pg_advisory_xact_lock``), expired leases reclaimed, the window
  checked, the first pending job claimed (``FOR UPDATE SKIP LOCKED``). Only a claim grows the
  window, so serialising claims makes the window check exact across hosts; the lock is never held
  across a network round trip. Row locks with ``SKIP LOCKED`` alone would let two claimers both
  see room for one job and both claim it: ``bench/manifest_bench.py`` measures both (the lock
  costs little; the overshoot is real). Every other transition locks only the rows it changes
  and never waits on the window lock.
- **take** uses ``FOR UPDATE SKIP LOCKED``, so trainer ranks on different hosts admit disjoint shards.
- **Liveness.** A claim records host name, boot id, pid and start time, and a lease deadline on the
  server's clock. Anyone reclaims an expired lease; a claim whose process is gone is reclaimable at
  once only by a process on the same host (same host name; another boot id proves it gone). A
  registered process heartbeats from a thread and counts as alive, seen from another host, while its
  heartbeat is younger than the plan's ``extract.registration_liveness_s`` (:mod:`.pg_procs`).
- **publish** checks the claim (state, worker, attempt and the claiming process: host, boot id,
  pid, start time; a worker id repeats across hosts, and an attempt count that ``claim_next``'s
  unflushed commit lost in a server crash repeats too) with the row locked, runs the commit
  callback (the shard's rename) and marks the job written, in one transaction. A late publish is
  refused (event ``refused``) and the worker deletes its shard. Retried after a lost connection,
  it reports success if its first try had committed (the job is written with this attempt's
  checksum) and otherwise finishes without renaming twice. claim and take record a token in the
  rows they change, so a retry finds what a first try that did commit took.
- **A trainer's fence.** A trainer that registered (exclusively) checks its registration in each
  of its transactions (:meth:`~.pg_procs.Registry.check_fence`, which also keeps another trainer's
  registration waiting until that transaction ends); once another trainer has replaced it (it was
  cut off past its lease), it stops instead of consuming.

A rename on a shared filesystem cannot be fenced: a worker stalled between its ownership check and
the rename for longer than ``idle_in_transaction_session_timeout`` could still rename over a newer
shard of its job. The checksum the manifest recorded catches that on read, and the job is re-extracted;
a shard renamed after its job was released or requeued is removed by the store's cleanup
(:meth:`Manifest.shard_unwanted`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterable

import numpy as np

from dflash_staged.manifest.base import Manifest, consume_ids, consume_refused, register_backend
from dflash_staged.manifest.pg_conn import PgAddress, Session, driver
from dflash_staged.manifest.pg_procs import Registry, reclaim_dead_here
from dflash_staged.manifest.pg_schema import FREE_CLAIM as _FREE
from dflash_staged.manifest.pg_schema import NOW, SampleReader, create_tables, schema_kind
from dflash_staged.manifest.states import (EXTRACTED, IN_WINDOW, ClaimResult, Job, ManifestError, NoSuchJobError,
                                           Proc, check_format_version, plan_identity)
from dflash_staged.procs import BOOT_ID, my_identity

_IN = lambda states: "(" + ",".join(f"'{s}'" for s in states) + ")"  # noqa: E731
_MINE = "worker = %s AND attempts = %s AND host = %s AND boot_id = %s AND pid = %s AND pid_start = %s"
_mine = lambda job: (job.worker, job.attempts, job.host, job.boot_id, job.pid, job.pid_start)  # noqa: E731


@register_backend
class PostgresManifest(Manifest):
    """A manifest in a PostgreSQL schema; see the module docstring."""

    CLAIM_LOCK = "advisory"  # "skip_locked": row locks only; for bench/manifest_bench.py (overshoots the window)

    def __init__(self, addr: PgAddress, session: Session, readonly: bool):
        self.addr, self.address, self._s, self.readonly = addr, addr.display, session, readonly
        self._meta: dict[str, Any] | None = None
        self._samples: SampleReader | None = None
        self._procs = Registry(addr, session, lambda: self.config.extract.registration_liveness, self._event)

    # ------------------------------------------------------------------ creation / opening
    @classmethod
    def handles(cls, address) -> bool:
        return str(address).startswith(("postgresql:", "postgres:"))

    @classmethod
    def _addr(cls, address) -> PgAddress:
        if not str(address).startswith(("postgresql://", "postgres://")):
            raise ManifestError(f"manifest address {str(address)!r} lost a '/' after 'postgresql:' (was it passed "
                                "through a filesystem path?); write postgresql://USER@HOST:PORT/DB#NAME")
        return PgAddress.parse(address)

    @classmethod
    def _exists(cls, address) -> bool:
        addr = cls._addr(address)
        s = Session(addr, schema=False)
        try:
            return s.run(lambda cur, _: schema_kind(cur, addr)) == "manifest"
        finally:
            s.close()

    @classmethod
    def _write_new(cls, address, **kw) -> None:
        addr = cls._addr(address)
        pg = driver()
        s = Session(addr, schema=False)
        try:
            s.run(lambda cur, _: create_tables(cur, pg, addr.name, kw))
        except pg.errors.DuplicateSchema:  # planned concurrently: it must hold this plan
            with cls._open(address, False) as m:
                m.check_same_plan(plan_identity(kw["config"].to_dict(), kw["data_hash"], kw["plan"].epochs,
                                                kw["plan"].seed))
        except pg.errors.InsufficientPrivilege as e:
            raise ManifestError(f"user {addr.user or '(default)'!r} may not create the manifest schema {addr.name!r} "
                                f"in database {addr.db!r} on {addr.server} ({' '.join(str(e).split())}): GRANT CREATE "
                                f"ON DATABASE {addr.db} TO that user, or use another database") from None
        finally:
            s.close()

    @classmethod
    def _open(cls, address, readonly: bool) -> "PostgresManifest":
        addr = cls._addr(address)
        s = Session(addr, readonly=readonly)
        try:
            kind = s.run(lambda cur, _: schema_kind(cur, addr))
            if kind == "none":
                raise ManifestError(f"no manifest {addr.name!r} in database {addr.db!r} on PostgreSQL server "
                                    f"{addr.server}: run `dflash plan --manifest '{addr.display}'` first (or fix the "
                                    "name after '#')")
            version = s.run(lambda cur, _: _one(cur, "SELECT value FROM meta WHERE key='format_version'"))
            check_format_version(json.loads(version["value"]) if version else None, addr.display)
        except BaseException:
            s.close()
            raise
        return cls(addr, s, readonly)

    def close(self) -> None:
        self._procs.close()
        self._s.close()

    def _run(self, body, fenced: bool = False):
        """``body`` in one transaction (:meth:`Session.run`); ``fenced``: a trainer's, checked against its registration."""
        if fenced and self._procs.fence:
            def checked(cur, again, inner=body):
                self._procs.check_fence(cur)
                return inner(cur, again)
            return self._s.run(checked)
        return self._s.run(body)

    def _all(self, q: str, args: tuple = ()) -> list[dict]:
        return self._run(lambda cur, _: cur.execute(q, args).fetchall())

    @staticmethod
    def _event(cur, job: int | None, kind: str, detail: str) -> None:
        cur.execute(f"INSERT INTO events (t, job, kind, detail) VALUES ({NOW}, %s, %s, %s)", (job, kind, detail))

    def now(self) -> float:
        return float(self._run(lambda cur, _: _one(cur, f"SELECT {NOW} AS t"))["t"])

    # ------------------------------------------------------------------ metadata and samples
    @property
    def meta(self) -> dict[str, Any]:
        if self._meta is None:
            self._meta = {r["key"]: json.loads(r["value"]) for r in self._all("SELECT key, value FROM meta")}
        return self._meta

    def set_meta(self, key: str, value: Any) -> None:
        self._run(lambda cur, _: cur.execute("INSERT INTO meta VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET "
                                             "value = EXCLUDED.value", (key, json.dumps(value))))
        self._meta = None

    def _reader(self) -> SampleReader:
        if self._samples is None:
            def fetch(name: str, a: int, b: int) -> dict[int, bytes]:
                rows = self._all("SELECT chunk, data FROM samples WHERE name = %s AND chunk BETWEEN %s AND %s",
                                 (name, a, b))
                return {r["chunk"]: bytes(r["data"]) for r in rows}
            self._samples = SampleReader(fetch, int(self.meta["sample_chunk"]))
        return self._samples

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self._reader().sample(i)

    def sample_lengths(self) -> np.ndarray:
        return np.diff(self._reader().offsets())

    # ------------------------------------------------------------------ queries
    def job(self, job_id: int) -> Job:
        rows = self._all("SELECT * FROM jobs WHERE id = %s", (job_id,))
        if not rows:
            raise NoSuchJobError(f"{self.address}: no job {job_id}")
        return Job.from_row(rows[0])

    def jobs(self, state: str | None = None) -> list[Job]:
        q, args = ("SELECT * FROM jobs WHERE state = %s ORDER BY id", (state,)) if state else \
            ("SELECT * FROM jobs ORDER BY id", ())
        return [Job.from_row(r) for r in self._all(q, args)]

    def _query(self, sql: str) -> list[dict]:
        return self._all(sql)

    @staticmethod
    def _window(cur) -> dict[str, int]:
        r = _one(cur, "SELECT COUNT(*) AS n, COALESCE(SUM(CASE WHEN state = 'claimed' THEN real_tokens::bigint * "
                      "COALESCE((SELECT value::bigint FROM meta WHERE key = 'bytes_per_token'), 0) ELSE "
                      f"COALESCE(shard_bytes, 0) END), 0) AS b FROM jobs WHERE state IN {_IN(IN_WINDOW)}")
        return {"shards": int(r["n"]), "bytes": int(r["b"])}

    def window(self) -> dict[str, int]:
        return self._run(lambda cur, _: self._window(cur))

    def ready_count(self) -> int:
        return int(self._all("SELECT COUNT(*) AS n FROM jobs WHERE state = 'written' AND taken_by IS NULL")[0]["n"])

    def consumed_upto(self, step: int) -> list[Job]:
        return [Job.from_row(r) for r in self._all(
            "SELECT * FROM jobs WHERE state = 'consumed' AND step IS NOT NULL AND step <= %s ORDER BY id", (step,))]

    def events(self, kind: str | None = None) -> list[dict]:
        q, args = ("SELECT * FROM events WHERE kind = %s ORDER BY id", (kind,)) if kind else \
            ("SELECT * FROM events ORDER BY id", ())
        return self._all(q, args)

    def requeue_reasons(self) -> dict[str, int]:
        reasons: dict[str, int] = {}
        for r in self._all("SELECT detail, COUNT(*) AS n FROM events WHERE kind = 'requeue' GROUP BY detail"):
            key = (r["detail"] or "").split(":", 1)[0]
            reasons[key] = reasons.get(key, 0) + int(r["n"])
        return reasons

    def failed_errors(self) -> list[tuple[Job, str]]:
        return [(Job.from_row(r), r["error"]) for r in self._all("SELECT * FROM jobs WHERE state = 'failed' ORDER BY id")]

    # ------------------------------------------------------------------ extract side
    def reclaim_stale(self) -> int:
        def body(cur, _):
            n = reclaim_dead_here(cur)
            return n + cur.execute(
                f"WITH gone AS (UPDATE jobs SET state = 'pending', {_FREE}, updated = {NOW} WHERE id IN (SELECT id FROM "
                f"jobs WHERE state = 'claimed' AND lease_until < {NOW} FOR UPDATE SKIP LOCKED) RETURNING id) "
                f"INSERT INTO events (t, job, kind, detail) SELECT {NOW}, id, 'reclaim', 'lease expired' FROM gone").rowcount
        return self._s.run(body, tx=False)

    def claim(self, worker: str, *, window: int, window_bytes: int = 0, lease_s: float = 300.0) -> ClaimResult:
        host, pid, start = my_identity()
        token = uuid.uuid4().hex

        def body(cur, again):
            if again:  # the first try may have committed: find what it claimed
                r = _one(cur, "SELECT * FROM jobs WHERE op_token = %s AND state = 'claimed'", (token,))
                if r is not None:
                    return ClaimResult(Job.from_row(r), window=self._window(cur))
            reclaim_dead_here(cur)
            r = _one(cur, "SELECT * FROM claim_next(hashtext(%s), %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                     (self.addr.name + ":window", self.CLAIM_LOCK == "advisory", window, window_bytes or 0, worker,
                      host, BOOT_ID, pid, start, float(lease_s), token))
            w = {"shards": int(r["shards"]), "bytes": int(r["nbytes"])}
            if r["status"] != "claimed":
                return ClaimResult(None, window=w, window_full=r["status"] == "full", nothing_left=r["status"] == "done")
            return ClaimResult(Job.from_row(r["job"]), window=w)
        return self._s.run(body, tx=False)  # statements of their own: no lock outlives a round trip

    @staticmethod
    def _owned(cur, job: Job) -> bool:
        return _one(cur, f"SELECT 1 AS ok FROM jobs WHERE id = %s AND state = 'claimed' AND {_MINE} "
                         "FOR UPDATE", (job.id, *_mine(job))) is not None

    def extend_lease(self, job: Job, lease_s: float) -> bool:
        def body(cur, _):  # not worth an fsync: an extension lost in a server crash only shortens the lease
            cur.execute("SET LOCAL synchronous_commit TO off")
            return cur.execute(f"UPDATE jobs SET lease_until = {NOW} + %s WHERE id = %s AND "
                               f"state = 'claimed' AND {_MINE}",
                               (float(lease_s), job.id, *_mine(job))).rowcount == 1
        return self._run(body)

    def publish(self, job: Job, nbytes: int, checksum: str, commit=None) -> bool:
        renamed = False

        def body(cur, again):
            nonlocal renamed
            if not self._owned(cur, job):
                r = _one(cur, f"SELECT state, checksum FROM jobs WHERE id = %s AND {_MINE}",
                         (job.id, *_mine(job)))
                if again and r and r["state"] in EXTRACTED and r["checksum"] == checksum:
                    return True  # a first try that committed before the connection broke
                self._event(cur, job.id, "refused", f"late publish by {job.worker} (attempt {job.attempts}): "
                                                    "the claim was lost")
                return False
            if commit is not None and not renamed:
                commit()
                renamed = True
            cur.execute(f"UPDATE jobs SET state = 'written', shard_bytes = %s, checksum = %s, lease_until = NULL, "
                        f"taken_by = NULL, rank = NULL, step = NULL, error = NULL, updated = {NOW}, "
                        "written_seq = nextval('written_seq') WHERE id = %s", (int(nbytes), checksum, job.id))
            return True
        return self._run(body)

    def give_back(self, job: Job, reason: str = "given back") -> bool:
        def body(cur, _):
            if not self._owned(cur, job):
                return False
            cur.execute(f"UPDATE jobs SET state = 'pending', {_FREE}, updated = {NOW} WHERE id = %s", (job.id,))
            self._event(cur, job.id, "abandon", reason)
            return True
        return self._run(body)

    def fail(self, job: Job, error: str, max_attempts: int) -> str | None:
        def body(cur, _):
            if not self._owned(cur, job):
                return None
            errors = _one(cur, "SELECT errors FROM jobs WHERE id = %s", (job.id,))["errors"]
            state = "failed" if errors + 1 >= max_attempts else "pending"
            cur.execute(f"UPDATE jobs SET state = %s, errors = errors + 1, error = %s, {_FREE}, updated = {NOW} "
                        "WHERE id = %s", (state, error[:2000], job.id))
            self._event(cur, job.id, "error", error[:2000])
            return state
        return self._run(body)

    def retry_failed(self) -> int:
        return self._run(lambda cur, _: cur.execute(f"UPDATE jobs SET state = 'pending', errors = 0, updated = {NOW} "
                                                    "WHERE state = 'failed'").rowcount)

    # ------------------------------------------------------------------ train side
    def take(self, trainer: str, rank: int, n: int) -> list[Job]:
        token = uuid.uuid4().hex

        def body(cur, again):
            if again:  # the first try may have committed
                rows = cur.execute("SELECT * FROM jobs WHERE op_token = %s AND state = 'written' ORDER BY written_seq",
                                   (token,)).fetchall()
                if rows:
                    return rows
            ids = [r["id"] for r in cur.execute(
                "SELECT id FROM jobs WHERE state = 'written' AND taken_by IS NULL ORDER BY written_seq LIMIT %s "
                "FOR UPDATE SKIP LOCKED", (n,)).fetchall()]
            if not ids:
                return []
            rows = cur.execute("UPDATE jobs SET taken_by = %s, rank = %s, op_token = %s WHERE id = ANY(%s) RETURNING *",
                               (trainer, rank, token, ids)).fetchall()
            return sorted(rows, key=lambda r: r["written_seq"])
        return [Job.from_row(r) for r in self._run(body, fenced=True)]

    def retake(self, trainer: str, rank: int, job_ids: Iterable[int]) -> list[Job]:
        ids = [int(i) for i in job_ids]
        got = {r["id"]: Job.from_row(r) for r in self._run(lambda cur, _: cur.execute(
            "UPDATE jobs SET taken_by = %s, rank = %s WHERE id = ANY(%s) AND state = 'written' AND "
            "(taken_by IS NULL OR (taken_by = %s AND rank = %s)) RETURNING *",
            (trainer, rank, ids, trainer, rank)).fetchall(), fenced=True)}
        return [got[i] for i in ids if i in got]

    def consume(self, job_ids: Iterable[int], step: int, rank_of: dict[int, int] | None = None) -> None:
        ids = consume_ids(job_ids)
        ranks = [(rank_of or {}).get(i) for i in ids]

        def body(cur, again):
            if again and len(ids) == _one(cur, "SELECT COUNT(*) AS n FROM jobs WHERE id = ANY(%s) AND "
                                               "state = 'consumed' AND step = %s", (ids, step))["n"]:
                return  # the first try committed
            done = {r["id"] for r in cur.execute(
                "UPDATE jobs AS j SET state = 'consumed', step = %s, rank = COALESCE(v.r, j.rank), "
                f"updated = {NOW} FROM unnest(%s::bigint[], %s::integer[]) AS v(id, r) WHERE j.id = v.id "
                "AND j.state = 'written' AND (j.taken_by IS NULL OR v.r IS NULL OR j.rank = v.r) "
                "RETURNING j.id", (step, ids, ranks))}
            if len(done) != len(ids):  # all or nothing: the exception rolls the transaction back
                bad = [i for i in ids if i not in done]
                rows = cur.execute("SELECT * FROM jobs WHERE id = ANY(%s)", (bad,)).fetchall()
                raise consume_refused(step, bad, {r["id"]: Job.from_row(r) for r in rows}, rank_of)
        self._run(body, fenced=True)

    def release(self, job_ids: Iterable[int], keep: bool = False) -> None:
        self._run(lambda cur, _: cur.execute(
            f"UPDATE jobs SET state = %s, taken_by = NULL, updated = {NOW} WHERE id = ANY(%s) AND state = 'consumed'",
            ("kept" if keep else "released", [int(i) for i in job_ids])), fenced=True)

    def requeue(self, job_id: int, reason: str) -> bool:
        def body(cur, _):
            n = cur.execute(f"UPDATE jobs SET state = 'pending', shard_bytes = NULL, checksum = NULL, written_seq = NULL, "
                            f"taken_by = NULL, rank = NULL, step = NULL, worker = NULL, updated = {NOW} "
                            "WHERE id = %s AND state IN ('written', 'consumed')", (job_id,)).rowcount
            if n:
                self._event(cur, job_id, "requeue", reason[:2000])
            return bool(n)
        return self._run(body, fenced=True)

    def resume_trainer(self, covered: dict[int, int]) -> list[int]:
        def body(cur, _):
            cur.execute("CREATE TEMP TABLE IF NOT EXISTS cov (id bigint PRIMARY KEY, step integer) ON COMMIT DELETE ROWS")
            with cur.copy("COPY cov (id, step) FROM STDIN") as cp:
                for i, s in covered.items():
                    cp.write_row((int(i), int(s)))
            cur.execute(f"UPDATE jobs SET state = 'written', step = NULL, updated = {NOW} WHERE state = 'consumed' "
                        "AND shard_bytes IS NOT NULL AND id NOT IN (SELECT id FROM cov)")
            cur.execute(f"UPDATE jobs AS j SET state = 'consumed', step = c.step, updated = {NOW} FROM cov AS c "
                        "WHERE j.id = c.id AND j.state NOT IN ('released', 'kept')")
            cur.execute("UPDATE jobs SET taken_by = NULL WHERE taken_by IS NOT NULL")
            return [r["id"] for r in cur.execute("SELECT id FROM jobs WHERE state = 'consumed' ORDER BY id").fetchall()]
        return self._run(body, fenced=True)

    # ------------------------------------------------------------------ processes
    def register(self, role: str, *, group_id: str | None = None, rank: int | None = None,
                 info: dict | None = None, exclusive: bool = False) -> str:
        return self._procs.register(role, group_id=group_id, rank=rank, info=info, exclusive=exclusive)

    def unregister(self, proc_id: str) -> None:
        self._procs.unregister(proc_id)

    def check_fence(self) -> None:
        if self._procs.fence:
            self._run(lambda cur, _: None, fenced=True)

    def live_procs(self, role: str | None = None) -> list[Proc]:
        return self._procs.live(role)

    def ever_registered(self, role: str) -> bool:
        return bool(self._all("SELECT 1 AS ok FROM events WHERE kind = %s LIMIT 1", (f"start:{role}",)))

    def log_event(self, kind: str, detail: str = "", job: int | None = None) -> None:
        self._run(lambda cur, _: self._event(cur, job, kind, detail))


def _one(cur, q: str, args: tuple = ()) -> dict | None:
    return cur.execute(q, args).fetchone()
