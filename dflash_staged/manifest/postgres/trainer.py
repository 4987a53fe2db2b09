"""The PostgreSQL manifest's train side: taking, consuming, releasing, requeueing, resuming.

:class:`PgTrainer` is a base of :class:`~dflash_staged.manifest.postgres.PostgresManifest`
(its connection and events are there). Across hosts:

- **take** uses ``FOR UPDATE SKIP LOCKED``, so trainer ranks on different hosts admit disjoint
  shards.
- **Retries** after a lost connection (:mod:`.conn`): take records a token in the rows it
  takes, so a retry finds what a first try that did commit took; a consume retried after its first
  try committed finds its jobs consumed at its step and changes nothing.
- **A trainer's fence.** A trainer that registered (exclusively) checks its registration in each
  of its transactions (:meth:`~.procs.Registry.check_fence`, which also keeps another trainer's
  registration waiting until that transaction ends); once another trainer has replaced it (it was
  cut off past its lease), it stops instead of consuming. Every transition here runs fenced.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from dflash_staged.manifest.consume import consume_ids, consume_refused
from dflash_staged.manifest.postgres.conn import one
from dflash_staged.manifest.postgres.schema import NOW
from dflash_staged.manifest.states import Job


class PgTrainer:
    """The train side of a :class:`~dflash_staged.manifest.postgres.PostgresManifest`, on its
    ``_run`` (``fenced=True``) and ``_event``; see the module docstring."""

    def take(self, trainer: str, rank: int, n: int, node: str | None = None) -> list[Job]:
        token = uuid.uuid4().hex

        def body(cur, again):
            if again:  # the first try may have committed
                rows = cur.execute(
                    "SELECT * FROM jobs WHERE op_token = %s AND state = 'written' ORDER BY written_seq",
                    (token,),
                ).fetchall()
                if rows:
                    return rows
            ids = [
                r["id"]
                for r in cur.execute(
                    "SELECT id FROM jobs WHERE state = 'written' AND taken_by IS NULL "
                    "AND (%s::text IS NULL OR host = %s::text) "
                    "ORDER BY written_seq LIMIT %s FOR UPDATE SKIP LOCKED",
                    (node, node, n),
                ).fetchall()
            ]
            if not ids:
                return []
            rows = cur.execute(
                "UPDATE jobs SET taken_by = %s, rank = %s, op_token = %s WHERE id = ANY(%s) RETURNING *",
                (trainer, rank, token, ids),
            ).fetchall()
            return sorted(rows, key=lambda r: r["written_seq"])

        return [Job.from_row(r) for r in self._run(body, fenced=True)]

    def retake(self, trainer: str, rank: int, job_ids: Iterable[int]) -> list[Job]:
        ids = [int(i) for i in job_ids]
        got = {
            r["id"]: Job.from_row(r)
            for r in self._run(
                lambda cur, _: cur.execute(
                    "UPDATE jobs SET taken_by = %s, rank = %s WHERE id = ANY(%s) AND state = 'written' AND "
                    "(taken_by IS NULL OR (taken_by = %s AND rank = %s)) RETURNING *",
                    (trainer, rank, ids, trainer, rank),
                ).fetchall(),
                fenced=True,
            )
        }
        return [got[i] for i in ids if i in got]

    def consume(self, job_ids: Iterable[int], step: int, rank_of: dict[int, int] | None = None) -> None:
        ids = consume_ids(job_ids)
        ranks = [(rank_of or {}).get(i) for i in ids]

        def body(cur, again):
            if (
                again
                and len(ids)
                == one(
                    cur,
                    "SELECT COUNT(*) AS n FROM jobs WHERE id = ANY(%s) AND state = 'consumed' AND step = %s",
                    (ids, step),
                )["n"]
            ):
                return  # the first try committed
            done = {
                r["id"]
                for r in cur.execute(
                    "UPDATE jobs AS j SET state = 'consumed', step = %s, rank = COALESCE(v.r, j.rank), "
                    f"updated = {NOW} FROM unnest(%s::bigint[], %s::integer[]) AS v(id, r) WHERE j.id = v.id "
                    "AND j.state = 'written' AND (j.taken_by IS NULL OR v.r IS NULL OR j.rank = v.r) "
                    "RETURNING j.id",
                    (step, ids, ranks),
                )
            }
            if len(done) != len(ids):  # all or nothing: the exception rolls the transaction back
                bad = [i for i in ids if i not in done]
                rows = cur.execute("SELECT * FROM jobs WHERE id = ANY(%s)", (bad,)).fetchall()
                raise consume_refused(step, bad, {r["id"]: Job.from_row(r) for r in rows}, rank_of)

        self._run(body, fenced=True)

    def release(self, job_ids: Iterable[int], keep: bool = False) -> None:
        self._run(
            lambda cur, _: cur.execute(
                f"UPDATE jobs SET state = %s, taken_by = NULL, updated = {NOW} "
                "WHERE id = ANY(%s) AND state = 'consumed'",
                ("kept" if keep else "released", [int(i) for i in job_ids]),
            ),
            fenced=True,
        )

    def requeue(self, job_id: int, reason: str) -> bool:
        def body(cur, _):
            n = cur.execute(
                "UPDATE jobs SET state = 'pending', shard_bytes = NULL, checksum = NULL, written_seq = NULL, "
                f"taken_by = NULL, rank = NULL, step = NULL, worker = NULL, updated = {NOW} "
                "WHERE id = %s AND state IN ('written', 'consumed')",
                (job_id,),
            ).rowcount
            if n:
                self._event(cur, job_id, "requeue", reason[:2000])
            return bool(n)

        return self._run(body, fenced=True)

    def requeue_absent_nodes(self, nodes: list[str]) -> tuple[int, int]:
        keep = sorted(set(nodes))

        def body(cur, _):
            absent = "host IS NOT NULL AND host <> ALL(%s)"
            ids = [
                r["id"]
                for r in cur.execute(
                    "UPDATE jobs SET state = 'pending', shard_bytes = NULL, checksum = NULL, "
                    "written_seq = NULL, taken_by = NULL, rank = NULL, step = NULL, worker = NULL, "
                    f"updated = {NOW} WHERE state = 'written' AND {absent} RETURNING id",
                    (keep,),
                ).fetchall()
            ]
            for i in ids:
                self._event(cur, i, "requeue", "lost node: its shard is on a node outside this trainer job")
            gone = cur.execute(
                f"UPDATE jobs SET state = 'released', taken_by = NULL, updated = {NOW} "
                f"WHERE state = 'consumed' AND {absent}",
                (keep,),
            ).rowcount
            return len(ids), gone

        return self._run(body, fenced=True)

    def resume_trainer(self, covered: dict[int, int]) -> list[int]:
        def body(cur, _):
            cur.execute(
                "CREATE TEMP TABLE IF NOT EXISTS cov (id bigint PRIMARY KEY, step integer) "
                "ON COMMIT DELETE ROWS"
            )
            with cur.copy("COPY cov (id, step) FROM STDIN") as cp:
                for i, s in covered.items():
                    cp.write_row((int(i), int(s)))
            cur.execute(
                f"UPDATE jobs SET state = 'written', step = NULL, updated = {NOW} WHERE state = 'consumed' "
                "AND shard_bytes IS NOT NULL AND id NOT IN (SELECT id FROM cov)"
            )
            cur.execute(
                f"UPDATE jobs AS j SET state = 'consumed', step = c.step, updated = {NOW} FROM cov AS c "
                "WHERE j.id = c.id AND j.state NOT IN ('released', 'kept')"
            )
            cur.execute("UPDATE jobs SET taken_by = NULL WHERE taken_by IS NOT NULL")
            return [
                r["id"]
                for r in cur.execute("SELECT id FROM jobs WHERE state = 'consumed' ORDER BY id").fetchall()
            ]

        return self._run(body, fenced=True)
