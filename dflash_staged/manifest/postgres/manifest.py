"""The PostgreSQL manifest: one run across many hosts.

Chosen by the address ``postgresql://USER@HOST:PORT/DB#NAME`` (:mod:`.conn`: the address,
connections, retrying a lost connection; :mod:`.schema`: the layout, and why the samples live
in the database). It implements the state machine of :mod:`.states` with the same job ids and the
same ``status --json`` as the SQLite backend; what differs is how hosts share it:

- **claim, leases, publish** (:mod:`.claims`): claims are serialised on the window by an
  advisory lock that one server-side statement holds, so the window check is exact across hosts
  and no lock outlives a network round trip; publish checks the claim with its row locked and runs
  the shard's rename inside that transaction; a late publish is refused.
- **take, consume, release, requeue, resume** (:mod:`.trainer`): trainer ranks on different
  hosts take disjoint shards (``FOR UPDATE SKIP LOCKED``); each of these transactions checks the
  trainer's fence, so a trainer that another one replaced stops instead of consuming.
- **Liveness.** A claim records host name, boot id, pid and start time, and a lease deadline on the
  server's clock. Anyone reclaims an expired lease; a claim whose process is gone is reclaimable at
  once only by a process on the same host (same host name; another boot id proves it gone). A
  registered process heartbeats from a thread and counts as alive, seen from another host, while its
  heartbeat is younger than the plan's ``extract.registration_liveness_s`` (:mod:`.procs`:
  registrations, heartbeats and the trainer's fence).
- **Retries.** Every operation is one transaction (:meth:`PostgresManifest._run`) that runs again
  from the start after a lost connection, told that it is a retry (:mod:`.conn`); each is
  written to be right whether or not its first try committed.

Metadata, samples, queries and registrations are in this module.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from dflash_staged.manifest.base import Manifest, register_backend
from dflash_staged.manifest.postgres.claims import PgClaims
from dflash_staged.manifest.postgres.conn import PgAddress, Session, driver, one
from dflash_staged.manifest.postgres.procs import Registry
from dflash_staged.manifest.postgres.schema import (
    NOW,
    SampleReader,
    create_tables,
    ensure_claim_function,
    schema_kind,
)
from dflash_staged.manifest.postgres.trainer import PgTrainer
from dflash_staged.manifest.states import (
    IN_WINDOW,
    Job,
    ManifestError,
    NoSuchJobError,
    Proc,
    check_format_version,
    plan_identity,
    plan_it_first,
)

_IN = lambda states: "(" + ",".join(f"'{s}'" for s in states) + ")"  # noqa: E731


@register_backend
class PostgresManifest(PgClaims, PgTrainer, Manifest):
    """A manifest in a PostgreSQL schema; see the module docstring."""

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
            raise ManifestError(
                f"manifest address {str(address)!r} lost a '/' after 'postgresql:' (was it passed "
                "through a filesystem path?); write postgresql://USER@HOST:PORT/DB#NAME"
            )
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
                m.check_same_plan(
                    plan_identity(kw["config"].to_dict(), kw["data_hash"], kw["plan"].epochs, kw["plan"].seed)
                )
        except pg.errors.InsufficientPrivilege as e:
            raise ManifestError(
                f"user {addr.user or '(default)'!r} may not create the manifest schema {addr.name!r} "
                f"in database {addr.db!r} on {addr.server} ({' '.join(str(e).split())}): GRANT CREATE "
                f"ON DATABASE {addr.db} TO that user, or use another database"
            ) from None
        finally:
            s.close()

    @classmethod
    def _open(cls, address, readonly: bool) -> PostgresManifest:
        addr = cls._addr(address)
        s = Session(addr, readonly=readonly)
        try:
            kind = s.run(lambda cur, _: schema_kind(cur, addr))
            if kind == "none":
                raise ManifestError(
                    f"no manifest {addr.name!r} in database {addr.db!r} on PostgreSQL server "
                    f"{addr.server}: {plan_it_first(repr(addr.display))} (or fix the "
                    "name after '#')"
                )
            version = s.run(lambda cur, _: one(cur, "SELECT value FROM meta WHERE key='format_version'"))
            check_format_version(json.loads(version["value"]) if version else None, addr.display)
            if not readonly:
                s.run(lambda cur, _: ensure_claim_function(cur, addr.name))
        except BaseException:
            s.close()
            raise
        return cls(addr, s, readonly)

    def close(self) -> None:
        self._procs.close()
        self._s.close()

    def _run(self, body, fenced: bool = False):
        """``body`` in one transaction (:meth:`Session.run`); ``fenced``: a trainer's, checked against
        its registration."""
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
        cur.execute(
            f"INSERT INTO events (t, job, kind, detail) VALUES ({NOW}, %s, %s, %s)", (job, kind, detail)
        )

    def now(self) -> float:
        return float(self._run(lambda cur, _: one(cur, f"SELECT {NOW} AS t"))["t"])

    # ------------------------------------------------------------------ metadata and samples
    @property
    def meta(self) -> dict[str, Any]:
        if self._meta is None:
            self._meta = {r["key"]: json.loads(r["value"]) for r in self._all("SELECT key, value FROM meta")}
        return self._meta

    def set_meta(self, key: str, value: Any) -> None:
        self._run(
            lambda cur, _: cur.execute(
                "INSERT INTO meta VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                (key, json.dumps(value)),
            )
        )
        self._meta = None

    def _reader(self) -> SampleReader:
        if self._samples is None:

            def fetch(name: str, a: int, b: int) -> dict[int, bytes]:
                rows = self._all(
                    "SELECT chunk, data FROM samples WHERE name = %s AND chunk BETWEEN %s AND %s",
                    (name, a, b),
                )
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
        q, args = (
            ("SELECT * FROM jobs WHERE state = %s ORDER BY id", (state,))
            if state
            else ("SELECT * FROM jobs ORDER BY id", ())
        )
        return [Job.from_row(r) for r in self._all(q, args)]

    def _query(self, sql: str) -> list[dict]:
        return self._all(sql)

    @staticmethod
    def _window(cur, node: str | None = None) -> dict[str, int]:
        r = one(
            cur,
            "SELECT COUNT(*) AS n, COALESCE(SUM(CASE WHEN state = 'claimed' THEN real_tokens::bigint * "
            "COALESCE((SELECT value::bigint FROM meta WHERE key = 'bytes_per_token'), 0) ELSE "
            f"COALESCE(shard_bytes, 0) END), 0) AS b FROM jobs WHERE state IN {_IN(IN_WINDOW)} "
            "AND (%s::text IS NULL OR host = %s::text)",
            (node, node),
        )
        return {"shards": int(r["n"]), "bytes": int(r["b"])}

    def window(self, node: str | None = None) -> dict[str, int]:
        return self._run(lambda cur, _: self._window(cur, node))

    def ready_count(self, node: str | None = None) -> int:
        q = "SELECT COUNT(*) AS n FROM jobs WHERE state = 'written' AND taken_by IS NULL"
        q += " AND (%s::text IS NULL OR host = %s::text)"
        return int(self._all(q, (node, node))[0]["n"])

    def consumed_upto(self, step: int) -> list[Job]:
        return [
            Job.from_row(r)
            for r in self._all(
                "SELECT * FROM jobs WHERE state = 'consumed' AND step IS NOT NULL AND step <= %s ORDER BY id",
                (step,),
            )
        ]

    def events(self, kind: str | None = None) -> list[dict]:
        q, args = (
            ("SELECT * FROM events WHERE kind = %s ORDER BY id", (kind,))
            if kind
            else ("SELECT * FROM events ORDER BY id", ())
        )
        return self._all(q, args)

    def requeue_reasons(self) -> dict[str, int]:
        reasons: dict[str, int] = {}
        for r in self._all("SELECT detail, COUNT(*) AS n FROM events WHERE kind = 'requeue' GROUP BY detail"):
            key = (r["detail"] or "").split(":", 1)[0]
            reasons[key] = reasons.get(key, 0) + int(r["n"])
        return reasons

    def failed_errors(self) -> list[tuple[Job, str]]:
        return [
            (Job.from_row(r), r["error"])
            for r in self._all("SELECT * FROM jobs WHERE state = 'failed' ORDER BY id")
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
        return self._procs.register(role, group_id=group_id, rank=rank, info=info, exclusive=exclusive)

    def unregister(self, proc_id: str) -> None:
        self._procs.unregister(proc_id)

    def check_fence(self) -> None:
        if self._procs.fence:
            self._run(lambda cur, _: None, fenced=True)

    def live_procs(self, role: str | None = None) -> list[Proc]:
        return self._procs.live(role)

    def report(self, role: str, figures: dict, final: bool = False) -> None:
        self._procs.report(role, figures, final)

    def ever_registered(self, role: str) -> bool:
        return bool(self._all("SELECT 1 AS ok FROM events WHERE kind = %s LIMIT 1", (f"start:{role}",)))

    def log_event(self, kind: str, detail: str = "", job: int | None = None) -> None:
        self._run(lambda cur, _: self._event(cur, job, kind, detail))
