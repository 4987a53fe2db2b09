"""Consumption, release and resume: the trainer's side of the manifest's state machine.

Rules (the state machine itself is :mod:`dflash_staged.manifest.states`):

* a shard is ``consumed`` when the optimizer step that used it completes; the ledger records
  ``step -> [[job, rank, tokens, bucket, mean length], ...]`` for every step, and this record
  goes into every checkpoint: it is the proof of what was trained;
* it is deleted and ``released`` (or ``kept`` with ``--keep-shards``) only after a durable
  checkpoint covers that step;
* the trainer never waits for shards while it holds consumed, unreleased ones: it checkpoints
  and releases first, which frees the extractor's window;
* on resume, the checkpoint's record decides what happened: listed jobs are consumed (and
  released now if they were not yet), every other consumed job returns to ``written``.

Only rank 0 of a live run writes to the manifest; a replay never does.
"""

from __future__ import annotations

from dflash_staged.manifest import Manifest


class Ledger:
    """What each step consumed, and the manifest bookkeeping around checkpoints."""

    def __init__(self, m: Manifest, store, *, live: bool, rank: int, keep_shards: bool):
        self.m, self.store = m, store
        self.live, self.rank, self.keep_shards = live, rank, keep_shards
        self.consumed: dict[int, list[list]] = {}  # step -> [[job, rank, tokens, bucket, mean length]]
        self.checkpointed = 0  # the step the newest durable checkpoint covers

    @property
    def writes(self) -> bool:
        return self.live and self.rank == 0

    def record(self, step: int, items: list) -> None:
        """Step ``step`` completed using these shards (``items`` from every rank)."""
        self.consumed[step] = [list(j) for j in items]
        if self.writes:
            self.m.consume([j[0] for j in items], step, {j[0]: j[1] for j in items})

    def holds_unreleased(self, step: int) -> bool:
        """Consumed shards no durable checkpoint covers yet (live runs only)."""
        return self.live and step > self.checkpointed

    def covered(self) -> dict[int, int]:
        """job id -> the step that consumed it."""
        return {int(j[0]): int(step) for step, items in self.consumed.items() for j in items}

    def checkpoint_done(self, step: int) -> None:
        """A checkpoint covering ``step`` is durable: release (or keep) what it covers."""
        self.checkpointed = step
        if self.writes:
            self._release([j.id for j in self.m.consumed_upto(step)])

    def restore(self, consumed: dict[int, list], step: int) -> None:
        """The record of a checkpoint at ``step`` (resume)."""
        self.consumed = {int(s): v for s, v in consumed.items()}
        self.checkpointed = step

    def reconcile(self) -> None:
        """Make the manifest agree with the record (resume, rank 0 of a live run)."""
        if self.writes:
            self._release(self.m.resume_trainer(self.covered()))

    def _release(self, job_ids: list[int]) -> None:
        if not job_ids:
            return
        if not self.keep_shards:
            for i in job_ids:
                j = self.m.job(i)
                self.store.delete_shard(j.epoch, j.id)
        self.m.release(job_ids, keep=self.keep_shards)
