"""The PostgreSQL manifest's extract side: claims, leases and publishing, shared by many hosts.

:class:`PgClaims` is a base of :class:`~dflash_staged.manifest.postgres.PostgresManifest`
(its connection, window query and events are there). Across hosts:

- **claim** returns this host's dead processes' claims to pending, then runs the server-side
  function ``claim_next`` (:mod:`.schema`) as one statement: a transaction-scoped advisory lock
  on the manifest's window (``pg_advisory_xact_lock``), expired leases reclaimed, the window
  checked, the first pending job claimed (``FOR UPDATE SKIP LOCKED``). Only a claim grows the
  window, so serialising claims makes the window check exact across hosts; the lock is never held
  across a network round trip. Row locks with ``SKIP LOCKED`` alone would let two claimers both
  see room for one job and both claim it: ``bench/manifest_bench.py`` measures both (the lock
  costs little; the overshoot is real). Every other transition locks only the rows it changes
  and never waits on the window lock. A claim records a token in the row it changes, so a claim
  retried after a lost connection finds what a first try that did commit took.
- **Leases** (who may reclaim a claim: the liveness rules of :mod:`.postgres`). The worker's
  heartbeat extends its lease (:meth:`PgClaims.extend_lease`) without waiting for the WAL flush:
  an extension lost in a server crash only shortens the lease.
- **publish** checks the claim (state, worker, attempt and the claiming process: host, boot id,
  pid, start time; a worker id repeats across hosts, and an attempt count that ``claim_next``'s
  unflushed commit lost in a server crash repeats too) with the row locked, runs the commit
  callback (the shard's rename) and marks the job written, in one transaction. A late publish is
  refused (event ``refused``) and the worker deletes its shard. Retried after a lost connection,
  it reports success if its first try had committed (the job is written with this attempt's
  checksum) and otherwise finishes without renaming twice.

A rename on a shared filesystem cannot be fenced: a worker stalled between its ownership check and
the rename for longer than ``idle_in_transaction_session_timeout`` could still rename over a newer
shard of its job. The checksum the manifest recorded catches that on read, and the job is
re-extracted; a shard renamed after its job was released or requeued is removed by the store's
cleanup (:meth:`~dflash_staged.manifest.base.Manifest.shard_unwanted`).
"""

from __future__ import annotations

import uuid

from dflash_staged.manifest.postgres.conn import one
from dflash_staged.manifest.postgres.procs import reclaim_dead_here
from dflash_staged.manifest.postgres.schema import FREE_CLAIM, NOW
from dflash_staged.manifest.states import EXTRACTED, ClaimResult, Job
from dflash_staged.procs import BOOT_ID, my_identity

# The claim a job holds, as its claimer saw it (the placeholders take _mine(job)).
_MINE = "worker = %s AND attempts = %s AND host = %s AND boot_id = %s AND pid = %s AND pid_start = %s"


def _mine(job: Job) -> tuple:
    return (job.worker, job.attempts, job.host, job.boot_id, job.pid, job.pid_start)


class PgClaims:
    """The extract side of a :class:`~dflash_staged.manifest.postgres.PostgresManifest`, on its
    ``addr``, ``_s``, ``_run``, ``_window`` and ``_event``; see the module docstring."""

    # "skip_locked": row locks only; for bench/manifest_bench.py (overshoots the window)
    CLAIM_LOCK = "advisory"

    def reclaim_stale(self) -> int:
        def body(cur, _):
            n = reclaim_dead_here(cur)
            return (
                n
                + cur.execute(
                    f"WITH gone AS (UPDATE jobs SET state = 'pending', {FREE_CLAIM}, updated = {NOW} "
                    f"WHERE id IN (SELECT id FROM jobs WHERE state = 'claimed' AND lease_until < {NOW} "
                    "FOR UPDATE SKIP LOCKED) RETURNING id) INSERT INTO events (t, job, kind, detail) "
                    f"SELECT {NOW}, id, 'reclaim', 'lease expired' FROM gone"
                ).rowcount
            )

        return self._s.run(body, tx=False)

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
        token = uuid.uuid4().hex

        def body(cur, again):
            if again:  # the first try may have committed: find what it claimed
                r = one(cur, "SELECT * FROM jobs WHERE op_token = %s AND state = 'claimed'", (token,))
                if r is not None:
                    return ClaimResult(Job.from_row(r), window=self._window(cur, node))
            reclaim_dead_here(cur)
            r = one(
                cur,
                "SELECT * FROM claim_next(hashtext(%s), %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s::text)",
                (
                    self.addr.name + ":window",
                    self.CLAIM_LOCK == "advisory",
                    window,
                    window_bytes or 0,
                    worker,
                    host,
                    BOOT_ID,
                    pid,
                    start,
                    float(lease_s),
                    token,
                    node,
                ),
            )
            w = {"shards": int(r["shards"]), "bytes": int(r["nbytes"])}
            if r["status"] != "claimed":
                return ClaimResult(
                    None, window=w, window_full=r["status"] == "full", nothing_left=r["status"] == "done"
                )
            return ClaimResult(Job.from_row(r["job"]), window=w)

        return self._s.run(body, tx=False)  # statements of their own: no lock outlives a round trip

    @staticmethod
    def _owned(cur, job: Job) -> bool:
        """Whether ``job`` (as claimed) still holds its claim; locks its row until the transaction ends."""
        return (
            one(
                cur,
                f"SELECT 1 AS ok FROM jobs WHERE id = %s AND state = 'claimed' AND {_MINE} FOR UPDATE",
                (job.id, *_mine(job)),
            )
            is not None
        )

    def extend_lease(self, job: Job, lease_s: float) -> bool:
        def body(cur, _):  # not worth an fsync: an extension lost in a server crash only shortens the lease
            cur.execute("SET LOCAL synchronous_commit TO off")
            return (
                cur.execute(
                    f"UPDATE jobs SET lease_until = {NOW} + %s WHERE id = %s AND "
                    f"state = 'claimed' AND {_MINE}",
                    (float(lease_s), job.id, *_mine(job)),
                ).rowcount
                == 1
            )

        return self._run(body)

    def publish(self, job: Job, nbytes: int, checksum: str, commit=None) -> bool:
        renamed = False

        def body(cur, again):
            nonlocal renamed
            if not self._owned(cur, job):
                r = one(
                    cur, f"SELECT state, checksum FROM jobs WHERE id = %s AND {_MINE}", (job.id, *_mine(job))
                )
                if again and r and r["state"] in EXTRACTED and r["checksum"] == checksum:
                    return True  # a first try that committed before the connection broke
                self._event(
                    cur,
                    job.id,
                    "refused",
                    f"late publish by {job.worker} (attempt {job.attempts}): the claim was lost",
                )
                return False
            if commit is not None and not renamed:
                commit()
                renamed = True
            cur.execute(
                f"UPDATE jobs SET state = 'written', shard_bytes = %s, checksum = %s, lease_until = NULL, "
                f"taken_by = NULL, rank = NULL, step = NULL, error = NULL, updated = {NOW}, "
                "written_seq = nextval('written_seq') WHERE id = %s",
                (int(nbytes), checksum, job.id),
            )
            return True

        return self._run(body)

    def give_back(self, job: Job, reason: str = "given back") -> bool:
        def body(cur, _):
            if not self._owned(cur, job):
                return False
            cur.execute(
                f"UPDATE jobs SET state = 'pending', {FREE_CLAIM}, updated = {NOW} WHERE id = %s", (job.id,)
            )
            self._event(cur, job.id, "abandon", reason)
            return True

        return self._run(body)

    def fail(self, job: Job, error: str, max_attempts: int) -> str | None:
        def body(cur, _):
            if not self._owned(cur, job):
                return None
            errors = one(cur, "SELECT errors FROM jobs WHERE id = %s", (job.id,))["errors"]
            state = "failed" if errors + 1 >= max_attempts else "pending"
            cur.execute(
                f"UPDATE jobs SET state = %s, errors = errors + 1, error = %s, {FREE_CLAIM}, updated = {NOW} "
                "WHERE id = %s",
                (state, error[:2000], job.id),
            )
            self._event(cur, job.id, "error", error[:2000])
            return state

        return self._run(body)

    def retry_failed(self) -> int:
        return self._run(
            lambda cur, _: (
                cur.execute(
                    f"UPDATE jobs SET state = 'pending', errors = 0, updated = {NOW} WHERE state = 'failed'"
                ).rowcount
            )
        )
