"""The queries every backend answers the same way, from the primitives of the manifest interface.

:class:`SharedQueries` is a base of :class:`~dflash_staged.manifest.base.Manifest`: jobs and real
tokens per state and per state group, whether extract is done, what ``dflash status --json``
prints (:mod:`.status` has its human form), each host's processes and claims, both sides' busy
and idle figures (:mod:`.balance`), and the two questions the store's cleanup asks about a shard
on disk. Each is built on the abstract operations of :class:`~dflash_staged.manifest.base.Manifest`
(``_query``, ``meta``, ``job``, ``jobs``, ``window``, ``live_procs``, ``now``, ...), so a backend
implements those and gets these.
"""

from __future__ import annotations

import json
import time
from typing import Any

from dflash_staged.manifest.balance import SIDES, by_node, collect, node_imbalance
from dflash_staged.manifest.layout import KEY as LAYOUT_KEY
from dflash_staged.manifest.states import STATES, TRAINED, NoSuchJobError, group_counts


class SharedQueries:
    """Derived queries of a :class:`~dflash_staged.manifest.base.Manifest`; see the module docstring."""

    def _by_state(self, expr: str) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for r in self._query(f"SELECT state, {expr} AS n FROM jobs GROUP BY state"):
            out[r["state"]] = int(r["n"] or 0)
        return out

    def counts(self) -> dict[str, int]:
        """Jobs per state (every state in :data:`STATES`, zeros included)."""
        return self._by_state("COUNT(*)")

    def tokens_by_state(self) -> dict[str, int]:
        """Real tokens per state (zeros included)."""
        return self._by_state("SUM(real_tokens)")

    def written_by(self, host: str, pids) -> tuple[int, int]:
        """(jobs, real tokens) extracted (written, consumed, released or kept) by these worker
        processes of ``host``: what one extract run published, whoever else shares the manifest."""
        pids = sorted({int(p) for p in pids})
        if not pids:
            return 0, 0
        h, listed = host.replace("'", "''"), ",".join(map(str, pids))
        rows = self._query(
            "SELECT COUNT(*) AS n, SUM(real_tokens) AS t FROM jobs WHERE state IN "
            f"('written', 'consumed', 'released', 'kept') AND host = '{h}' AND pid IN ({listed})"
        )
        return int(rows[0]["n"] or 0), int(rows[0]["t"] or 0)

    def extract_done(self) -> bool:
        """No job is pending or claimed."""
        return group_counts(self.counts())["to_extract"] == 0

    def progress(self) -> dict[str, dict[str, int]]:
        """Jobs and real tokens per named state group (``extracted``, ``trained``, ...)."""
        return {"jobs": group_counts(self.counts()), "tokens": group_counts(self.tokens_by_state())}

    def _finished_figures(self) -> dict[str, list[dict]]:
        finished: dict[str, list[dict]] = {}
        for role in SIDES:
            finished[role] = []
            for e in self.events(f"balance:{role}"):
                try:
                    finished[role].append(json.loads(e["detail"] or "{}"))
                except ValueError:
                    continue
        return finished

    def balance(self, procs=None, counts=None) -> dict[str, Any]:
        """Both sides' busy and idle figures and the bottleneck (:func:`.balance.collect`), from the live
        registrations (``procs``, by default read now) or the last runs' final figures; ``counts``: jobs
        per state (by default read now), for the jobs left to train."""
        counts = self.counts() if counts is None else counts
        left = sum(counts.get(s, 0) for s in STATES if s not in TRAINED and s != "failed")
        return collect(
            self.live_procs() if procs is None else procs, self._finished_figures(), time.time(), left
        )

    def nodes(self, procs=None) -> dict[str, Any] | None:
        """Node-local stores (:mod:`.layout`): per node its window, its shards ready for its ranks and its
        balance (:func:`.balance.by_node`), and a node starved while another's window is full
        (``imbalance``); None with one shared store."""
        if self.meta.get(LAYOUT_KEY) != "node":
            return None
        per = by_node(self.live_procs() if procs is None else procs, self._finished_figures(), time.time())
        nodes = {
            h: {"window": self.window(h), "ready": self.ready_count(h), "balance": b} for h, b in per.items()
        }
        return {"nodes": nodes, "imbalance": node_imbalance(per)}

    def status(self) -> dict[str, Any]:
        """What ``dflash status --json`` prints."""
        m, counts, procs = self.meta, self.counts(), self.live_procs()
        return {
            "manifest": self.address,
            "manifest_id": m["manifest_id"],
            "jobs": counts,
            "total_jobs": sum(counts.values()),
            "epochs": int(m["epochs"]),
            "window": self.window(),
            "padding_waste": float(m["padding_waste"]),
            "extract_done": group_counts(counts)["to_extract"] == 0,
            "tokens": {"real": int(m["tokens_real"]), "padded": int(m["tokens_padded"])},
            "tokens_by_state": self.tokens_by_state(),
            "groups": group_counts(counts),
            "samples": int(m["n_samples"]),
            "target_id": m["target_id"],
            "layer_ids": m["layer_ids"],
            "store": self.store_sizes(),
            "reformations": self.reformations(),
            "requeued": self.requeue_reasons(),
            "failed": [{"id": j.id, "error": e} for j, e in self.failed_errors()],
            "processes": [{"role": p.role, "host": p.host, "pid": p.pid, "rank": p.rank} for p in procs],
            "hosts": self.hosts(),
            "balance": self.balance(procs, counts),
            "nodes": self.nodes(procs),
        }

    def reformations(self) -> list[dict[str, Any]]:
        """The trainer's re-formations (recorded by :func:`dflash_staged.train.catchup.record_reformation`):
        when, from which step, the ranks before and after, the nodes that left and came."""
        import json

        out = []
        for e in self.events("reform"):
            try:
                out.append({"t": e["t"], **json.loads(e["detail"])})
            except (ValueError, TypeError):
                continue
        return out

    def store_sizes(self) -> dict[str, Any]:
        """The shards' bytes a token (recorded by extract; 0 before) and what they hold, from the plan."""
        t, e = self.config.target, self.config.extract
        return {
            "bytes_per_token": int(self.meta.get("bytes_per_token") or 0),
            "store_dtype": e.store_dtype,
            "last_layer": bool(t.store_last_layer),
            "topk": int(t.store_topk),
        }

    def hosts(self) -> list[dict[str, Any]]:
        """Per host: its live processes (with the age of their last heartbeat, where kept) and its
        extract workers' claims with the seconds left on their leases; in ``status``."""
        now, out = self.now(), {}

        def entry(host):
            return out.setdefault(host, {"host": host, "processes": [], "workers": []})

        for p in self.live_procs():
            entry(p.host)["processes"].append(
                {
                    "role": p.role,
                    "pid": p.pid,
                    "rank": p.rank,
                    "heartbeat_age_s": None if p.heartbeat is None else round(now - p.heartbeat, 1),
                }
            )
        workers: dict[tuple, dict] = {}
        for j in self.jobs("claimed"):
            w = workers.setdefault(
                (j.host, j.worker, j.pid),
                {"worker": j.worker, "pid": j.pid, "jobs": [], "lease_left_s": None},
            )
            w["jobs"].append(j.id)
            if j.lease_until is not None:
                left = round(j.lease_until - now, 1)
                w["lease_left_s"] = left if w["lease_left_s"] is None else min(w["lease_left_s"], left)
        for (host, _, _), w in sorted(workers.items(), key=lambda kv: str(kv[0])):
            entry(host)["workers"].append(w)
        return [out[h] for h in sorted(out, key=str)]

    def holds_claim(self, job_id: int, host: str, pid: int) -> bool:
        """Whether process ``pid`` on ``host`` still holds the claim on job ``job_id`` (a staged shard
        of another host whose claim it no longer holds is an orphan)."""
        try:
            j = self.job(job_id)
        except NoSuchJobError:
            return False
        return j.state == "claimed" and j.host == host and j.pid == pid

    def shard_unwanted(self, job_id: int, node: str | None = None) -> bool:
        """Whether no shard of job ``job_id`` should be on disk: it is released, pending or failed (a
        late rename after its job was released or requeued left one; a claimed job's old shard is
        replaced when it publishes), or (``node``: a node-local store, :mod:`.layout`) another node
        holds or claimed the job. False for an unknown job."""
        try:
            j = self.job(job_id)
        except NoSuchJobError:
            return False
        return j.state in ("released", "pending", "failed") or (node is not None and j.host != node)
