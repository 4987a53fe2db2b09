"""The PostgreSQL manifest's layout, and creating one in a single transaction.

A manifest NAME is the schema NAME in the address's database::

    meta     (key text PRIMARY KEY, value text)     JSON values: the same keys as every backend
                                                    (:func:`~dflash_staged.manifest.build.plan_meta`)
    jobs     one row per job: the columns of the SQLite backend plus boot_id (host identity across
             reboots) and op_token (the claim or take that last touched the row, so that an
             operation retried after a lost connection finds what its first try did)
    events   (id bigserial, t, job, kind, detail)
    procs    registered extract/train processes: host, boot_id, pid, pid_start, heartbeat, ...
    samples  (name, chunk, data bytea): the plan's immutable arrays ``tokens`` (int32),
             ``loss_mask`` (uint8) and ``offsets`` (int64 [N+1]), little-endian, cut into rows of
             :data:`CHUNK` elements
    written_seq                                     a sequence: the order in which shards were written

**Why the samples live in the database** (and not in a shared directory beside the store): ``plan``
stays one transaction (a failed or killed plan leaves nothing, a concurrent plan of the same
name waits and then finds it), no extra path has to be mounted at the same place on every host,
and the arrays are small next to what they produce (5 bytes per token against kilobytes of
hidden states per token). A worker reads the offsets once and then only the chunks its jobs
touch (cached), so no host loads the whole data set.

Times (leases, heartbeats, ``updated``) are the server's clock, ``extract(epoch from
clock_timestamp())``: one clock for every host, whatever their own clocks say.
"""

from __future__ import annotations

import json

import numpy as np

from dflash_staged.manifest.build import job_rows, plan_meta
from dflash_staged.manifest.states import ManifestError

NOW = "extract(epoch from clock_timestamp())::float8"
# A job's claim columns, cleared (UPDATE jobs SET ... of a job leaving ``claimed``).
FREE_CLAIM = "worker=NULL, host=NULL, boot_id=NULL, pid=NULL, pid_start=NULL, lease_until=NULL"
LOCK_NS = 0x64666C61  # 'dfla': the first key of this package's advisory locks
CHUNK = 1 << 22  # elements per row of the samples table (16 MiB of tokens)
ARRAYS = {"tokens": np.dtype("<i4"), "loss_mask": np.dtype("u1"), "offsets": np.dtype("<i8")}

DDL = """
CREATE TABLE meta (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE jobs (
  id bigint PRIMARY KEY, epoch integer NOT NULL, pos integer NOT NULL, bucket integer NOT NULL,
  sample_ids bigint[] NOT NULL, real_tokens integer NOT NULL, padded_tokens integer NOT NULL,
  state text NOT NULL DEFAULT 'pending',
  worker text, host text, boot_id text, pid integer, pid_start bigint, lease_until double precision,
  attempts integer NOT NULL DEFAULT 0, errors integer NOT NULL DEFAULT 0, error text,
  shard_bytes bigint, checksum text, written_seq bigint,
  taken_by text, rank integer, step integer, updated double precision, op_token text);
CREATE INDEX jobs_state ON jobs (state, epoch, pos);
CREATE INDEX jobs_ready ON jobs (written_seq) WHERE state = 'written' AND taken_by IS NULL;
CREATE TABLE events (id bigserial PRIMARY KEY, t double precision NOT NULL, job bigint, kind text NOT NULL,
                     detail text);
CREATE INDEX events_kind ON events (kind);
CREATE TABLE procs (
  id text PRIMARY KEY, role text NOT NULL, host text NOT NULL, boot_id text, pid integer NOT NULL,
  pid_start bigint, group_id text, rank integer, started double precision, heartbeat double precision,
  info text);
CREATE TABLE samples (name text NOT NULL, chunk integer NOT NULL, data bytea NOT NULL,
                      PRIMARY KEY (name, chunk));
CREATE SEQUENCE written_seq;
"""

# claim_next: the window check (with p_node, the window of that node's jobs: a node-local store) and
# the claim as one server-side statement, so the window lock
# is held only while the server runs it, never across a network round trip (a client cut off
# midway cannot stall every other claimer). In READ COMMITTED each statement of a volatile
# function takes a new snapshot: after the lock, the count sees every claim committed before it.
# Its commit does not wait for the WAL flush (synchronous_commit off), so the lock is not held
# through an fsync: a claim lost in a server crash only returns its job to pending, and the
# worker's publish is then refused; any later synchronous commit (a publish) flushes it first.
CLAIM_FUNCTION = f"""
CREATE FUNCTION claim_next(p_key integer, p_lock boolean, p_window bigint, p_window_bytes bigint,
    p_worker text, p_host text, p_boot text, p_pid integer, p_pid_start bigint, p_lease double precision,
    p_token text, p_node text,
    OUT status text, OUT shards bigint, OUT nbytes bigint, OUT job jsonb) LANGUAGE plpgsql AS $$
DECLARE
  now_s double precision;
  pick bigint;
  bpt bigint;
BEGIN
  PERFORM set_config('synchronous_commit', 'off', true);
  IF p_lock THEN
    PERFORM pg_advisory_xact_lock({LOCK_NS}, p_key);
  END IF;
  now_s := {NOW};
  WITH gone AS (
    UPDATE jobs SET state = 'pending', worker = NULL, host = NULL, boot_id = NULL, pid = NULL,
                    pid_start = NULL, lease_until = NULL, updated = now_s
    WHERE id IN (SELECT id FROM jobs WHERE state = 'claimed' AND lease_until < now_s FOR UPDATE SKIP LOCKED)
    RETURNING id)
  INSERT INTO events (t, job, kind, detail) SELECT now_s, id, 'reclaim', 'lease expired' FROM gone;
  bpt := COALESCE((SELECT value::bigint FROM meta WHERE key = 'bytes_per_token'), 0);
  SELECT COUNT(*), COALESCE(SUM(CASE WHEN state = 'claimed' THEN real_tokens::bigint * bpt
                                     ELSE COALESCE(shard_bytes, 0) END), 0)
    INTO shards, nbytes FROM jobs
    WHERE state IN ('claimed', 'written', 'consumed') AND (p_node IS NULL OR host = p_node);
  SELECT id INTO pick FROM jobs WHERE state = 'pending' ORDER BY epoch, pos LIMIT 1 FOR UPDATE SKIP LOCKED;
  IF pick IS NULL THEN
    status := CASE WHEN EXISTS (SELECT 1 FROM jobs WHERE state IN ('pending', 'claimed'))
                   THEN 'none' ELSE 'done' END;
  ELSIF shards >= p_window OR (p_window_bytes > 0 AND nbytes >= p_window_bytes) THEN
    status := 'full';
  ELSE
    UPDATE jobs SET state = 'claimed', worker = p_worker, host = p_host, boot_id = p_boot, pid = p_pid,
                    pid_start = p_pid_start, lease_until = now_s + p_lease, attempts = attempts + 1,
                    updated = now_s, op_token = p_token
      WHERE id = pick RETURNING to_jsonb(jobs.*) INTO job;
    status := 'claimed';
  END IF;
END $$
"""


CLAIM_SIGNATURE = (
    "claim_next(integer,boolean,bigint,bigint,text,text,text,integer,bigint,double precision,text,text)"
)


def ensure_claim_function(cur, name: str) -> None:
    """Create this version's ``claim_next`` in a manifest planned before it took ``p_node`` (the
    older overload stays, unused); serialised by an advisory lock, so concurrent openers create it once."""
    probe = "SELECT to_regprocedure(%s) IS NOT NULL AS ok"
    if cur.execute(probe, (f"{name}.{CLAIM_SIGNATURE}",)).fetchone()["ok"]:
        return
    cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (LOCK_NS, name + ":schema"))
    if not cur.execute(probe, (f"{name}.{CLAIM_SIGNATURE}",)).fetchone()["ok"]:
        cur.execute(CLAIM_FUNCTION)


def create_tables(cur, pg, name: str, plan_kw: dict) -> None:
    """CREATE SCHEMA name and fill it (the caller's transaction makes it atomic)."""
    sql = pg.sql
    cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    cur.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(name)))
    for stmt in filter(str.strip, DDL.split(";")):
        cur.execute(stmt)
    cur.execute(CLAIM_FUNCTION)
    samples = plan_kw["samples"]
    for array, dtype in ARRAYS.items():
        data = np.ascontiguousarray(getattr(samples, array), dtype=dtype)
        rows = [
            (array, i, data[a : a + CHUNK].tobytes())
            for i, a in enumerate(range(0, max(len(data), 1), CHUNK))
        ]
        cur.executemany("INSERT INTO samples (name, chunk, data) VALUES (%s, %s, %s)", rows)
    meta = plan_meta(**plan_kw)
    meta["sample_chunk"] = CHUNK
    cur.executemany(
        "INSERT INTO meta (key, value) VALUES (%s, %s)", [(k, json.dumps(v)) for k, v in meta.items()]
    )
    with cur.copy(
        "COPY jobs (id, epoch, pos, bucket, sample_ids, real_tokens, padded_tokens) FROM STDIN"
    ) as cp:
        for r in job_rows(plan_kw["plan"]):
            cp.write_row(r)


def schema_kind(cur, addr) -> str:
    """'none' (no such schema) or 'manifest'; ManifestError for a schema that holds something else."""
    if cur.execute("SELECT 1 AS ok FROM pg_namespace WHERE nspname = %s", (addr.name,)).fetchone() is None:
        return "none"
    if (
        cur.execute("SELECT to_regclass(format('%%I.meta', %s::text)) AS t", (addr.name,)).fetchone()["t"]
        is None
    ):
        raise ManifestError(
            f"schema {addr.name!r} in database {addr.db!r} on {addr.server} exists but holds no dflash "
            "manifest: choose another manifest name after '#'"
        )
    return "manifest"


class SampleReader:
    """The plan's samples, read from the ``samples`` table chunk by chunk (a few chunks cached)."""

    def __init__(self, fetch, chunk: int, cache: int = 4):
        self._fetch, self.chunk, self._cache_n = fetch, chunk, cache  # fetch(name, first, last) -> {i: bytes}
        self._cache: dict[tuple[str, int], np.ndarray] = {}
        self._offsets: np.ndarray | None = None

    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            rows = self._fetch("offsets", 0, 2**31 - 1)
            self._offsets = np.concatenate([np.frombuffer(rows[i], ARRAYS["offsets"]) for i in sorted(rows)])
        return self._offsets

    def _range(self, name: str, a: int, b: int) -> np.ndarray:
        first, last = a // self.chunk, max(a, b - 1) // self.chunk
        missing = [i for i in range(first, last + 1) if (name, i) not in self._cache]
        if missing:
            for i, data in self._fetch(name, missing[0], missing[-1]).items():
                self._cache[(name, i)] = np.frombuffer(data, ARRAYS[name])
        parts = [self._cache[(name, i)] for i in range(first, last + 1)]
        while len(self._cache) > self._cache_n:  # oldest first; `parts` holds what this read needs
            self._cache.pop(next(iter(self._cache)))
        joined = parts[0] if len(parts) == 1 else np.concatenate(parts)
        base = first * self.chunk
        return joined[a - base : b - base]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        off = self.offsets()
        a, b = int(off[i]), int(off[i + 1])
        return self._range("tokens", a, b).astype(np.int32), self._range("loss_mask", a, b).astype(np.uint8)
