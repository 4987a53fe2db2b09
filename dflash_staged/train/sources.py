"""Where the trainer's shards come from: the live manifest, or a kept store replayed offline.

:class:`LiveSource` tails the manifest: it admits ``written`` shards oldest first
(marking them taken by this trainer and rank), sends shards that fail
verification back for re-extraction, and knows when extraction is finished.
:class:`ReplaySource` reads a kept store through a read-only manifest: no
tailing, no waiting, no target, no manifest writes; its admission order is a
pure function of the manifest, so replays are deterministic. With an order file
(``--order-from``) each step takes exactly the jobs a previous run recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dflash_staged.errors import DflashError
from dflash_staged.manifest import Job, Manifest

EXTRACTOR_GRACE_S = 20.0


class DrainError(DflashError):
    """Training cannot finish: jobs remain that nobody will extract, or jobs failed."""


@dataclass
class Forced:
    job: Job
    future: object


class LiveSource:
    live = True

    def __init__(self, manifest: Manifest, store, trainer_id: str, rank: int, node: str | None = None):
        self.m, self.store, self.trainer_id, self.rank = manifest, store, trainer_id, rank
        self.node = node  # node-local stores: this rank's node, whose shards alone it takes
        self._no_extractor_since: float | None = None

    def fill(self, buffer) -> None:
        if buffer.free:
            buffer.admit(self.m.take(self.trainer_id, self.rank, buffer.free, node=self.node))

    def admit_ids(self, buffer, ids: list[int]) -> None:
        """Re-admit a checkpoint's buffer contents (in order) after resume: with node-local stores only
        those its node holds (a job with fewer nodes gives a rank another node's buffer to resume)."""
        if self.node is not None:
            ids = [i for i in ids if self.m.job(i).host == self.node]
        buffer.admit(self.m.retake(self.trainer_id, self.rank, ids))

    def finished(self) -> bool:
        """Nothing more will come: extraction is done and no shard this rank may take is left."""
        return self.m.extract_done() and self.m.ready_count(self.node) == 0

    def state_dict(self) -> dict:  # the manifest is the live source's state
        return {"replay_pos": None}

    def load_state_dict(self, state) -> None:
        pass

    def forced_step(self, step: int) -> list:
        return []

    def bad_shard(self, job: Job, err: Exception) -> None:
        self.m.requeue(job.id, f"{type(err).__name__}: {err}")

    def check_progress_possible(self) -> None:
        """Raise if pending jobs remain but no extractor has been alive for a while."""
        self.m.reclaim_stale()  # claims of dead workers go back to pending
        c = self.m.counts()
        if (
            c["pending"] == 0
            or c["claimed"] > 0
            or self.m.live_procs("extract")
            or not self.m.ever_registered("extract")
        ):
            self._no_extractor_since = None
            return
        now = time.time()
        if self._no_extractor_since is None:
            self._no_extractor_since = now
        elif now - self._no_extractor_since > EXTRACTOR_GRACE_S:
            ids = [j.id for j in self.m.jobs("pending")]
            shown = ", ".join(map(str, ids[:20])) + (" ..." if len(ids) > 20 else "")
            raise DrainError(
                f"{len(ids)} job(s) are still pending ({shown}) but no `dflash extract` is running for "
                f"{self.m.address}; rerun `dflash extract --manifest {self.m.address} --store "
                f"{self.store.root}` and then this command"
            )

    def final_status(self) -> int:
        failed = self.m.jobs("failed")
        if failed:
            raise DrainError(
                f"{len(failed)} job(s) failed extraction and were not trained: "
                + "; ".join(f"job {j.id}" for j in failed[:20])
                + f". See `dflash status --manifest {self.m.address}`, fix the cause, rerun "
                "`dflash extract` (it retries failed jobs), then rerun this command"
            )
        return 0


class ReplaySource:
    """Kept shards of a manifest, in written order, `passes` times; or a recorded order."""

    live = False

    def __init__(
        self,
        manifest: Manifest,
        store,
        passes: int = 1,
        order: dict[int, list[int]] | None = None,
        node: str | None = None,
    ):
        self.m, self.store = manifest, store
        kept = [j for j in manifest.jobs("kept") if node is None or j.host == node]  # node: this node's
        if not kept:
            raise DflashError(
                f"{manifest.address} has no kept shards to replay{f' on node {node}' if node else ''}; run "
                "the live trainer with --keep-shards first"
            )
        kept.sort(key=lambda j: (j.epoch, j.pos))
        self.by_id = {j.id: j for j in kept}
        self.order = order
        if order:
            missing = sorted({i for ids in order.values() for i in ids} - set(self.by_id))
            if missing:
                raise DflashError(
                    f"--order-from lists jobs that are not kept in {manifest.address}: {missing[:10]}; "
                    "replay needs the shards kept (--keep-shards) by the recorded run"
                )
            self.sequence: list[Job] = []
        else:
            self.sequence = kept * passes
        self.pos = 0  # how much of the sequence has been admitted

    def fill(self, buffer) -> None:
        n = min(buffer.free, len(self.sequence) - self.pos)
        if n > 0:
            buffer.admit(self.sequence[self.pos : self.pos + n])
            self.pos += n

    def admit_ids(self, buffer, ids: list[int]) -> None:
        buffer.admit([self.by_id[i] for i in ids])

    def finished(self) -> bool:
        return self.pos >= len(self.sequence)

    def state_dict(self) -> dict:
        return {"replay_pos": self.pos}

    def load_state_dict(self, state) -> None:
        if state.get("replay_pos") is not None:
            self.pos = int(state["replay_pos"])

    def forced_step(self, step: int) -> list:
        if not self.order:
            return []
        return [Forced(self.by_id[i], self._read(self.by_id[i])) for i in self.order.get(step + 1, [])]

    def _read(self, job: Job):
        import concurrent.futures as cf

        f: cf.Future = cf.Future()
        try:
            f.set_result(self.store.read_shard(job.epoch, job.id, job.checksum, True))
        except BaseException as e:  # noqa: BLE001
            f.set_exception(e)
        return f

    def order_done(self, step: int) -> bool:
        return bool(self.order) and step >= max(self.order)

    def bad_shard(self, job: Job, err: Exception) -> None:
        raise DflashError(
            f"replay: kept shard of job {job.id} failed verification ({err}); a replay cannot "
            "re-extract it. Rerun the live pipeline for this manifest, or replay another store"
        )

    def check_progress_possible(self) -> None:
        return None

    def final_status(self) -> int:
        return 0
