"""Consumption, release and resume: the trainer's side of the manifest's state machine.

Rules (the state machine itself is :mod:`dflash_staged.manifest.states`):

* a shard is ``consumed`` when the optimizer step that used it completes; the ledger records
  ``step -> [Consumed, ...]`` for every step, and this record goes into every checkpoint: it is
  the proof of what was trained, down to a digest of the token ids the model was fed. The
  manifest refuses to consume a job that is not ``written`` (say, taken twice), so a step that
  would count a job twice stops the trainer before it is recorded;
* it is deleted and ``released`` (or ``kept`` with ``--keep-shards``) only after a durable
  checkpoint covers that step: renamed away at once, its files removed on a background thread
  (:class:`~dflash_staged.store.Remover`), and marked ``released`` only once those files are gone
  (:meth:`Ledger.poll`, called between steps and while waiting; at the latest before the next
  batch is deleted), so extract's window, which counts consumed shards, never lets the store hold
  more bytes than it allows;
* the trainer never waits for shards on a full window while it holds consumed, unreleased ones:
  it checkpoints and releases them, which frees the extractor's window (when:
  :mod:`dflash_staged.train.draw`);
* on resume, the checkpoint's record decides what happened: listed jobs are consumed (and
  released now if they were not yet), every other consumed job returns to ``written``.

Only rank 0 of a live run records consumption and reconciles; a replay never writes. Rank 0 also
deletes and releases, except with node-local stores (:mod:`dflash_staged.manifest.layout`), where the
lowest rank of each node deletes and releases its node's shards (after rank 0 has reconciled, on
resume).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np
import xxhash

from dflash_staged.errors import DflashError
from dflash_staged.manifest import Manifest
from dflash_staged.store import Remover


class Consumed(NamedTuple):
    """One job an optimizer step trained on (a list in the checkpoint's ``consumed`` record)."""

    job: int
    rank: int
    tokens: int  # real tokens
    bucket: int
    mean_len: float  # mean sequence length
    digest: str = ""  # token_digest() of the ids trained ("" in checkpoints older than the digest)


def read_record(raw: dict[str, list]) -> dict[int, list[Consumed]]:
    """A checkpoint's ``consumed`` record as ``step -> [Consumed, ...]``."""
    return {int(s): [Consumed(*c) for c in v] for s, v in raw.items()}


def token_digest(ids) -> str:
    """xxh3-64 of a job's packed token ids as int32, in the plan's sample order: what the model saw."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(np.asarray(ids, dtype=np.int32)).tobytes())


class Ledger:
    """What each step consumed, and the manifest bookkeeping around checkpoints."""

    def __init__(
        self,
        m: Manifest,
        store,
        *,
        live: bool,
        rank: int,
        keep_shards: bool,
        node: str | None = None,
        nodes: tuple[str, ...] = (),
        node_leader: bool = False,
    ):
        self.m, self.store = m, store
        self.live, self.rank, self.keep_shards = live, rank, keep_shards
        # node-local stores: this rank's node, the trainer job's nodes, whether it deletes its node's shards
        self.node, self.nodes, self.node_leader = node, tuple(nodes), node_leader
        self.consumed: dict[int, list[Consumed]] = {}
        self.checkpointed = 0  # the step the newest durable checkpoint covers
        self.remover = Remover()  # released shards' files go on a background thread
        self.deleting: list[int] = []  # jobs whose files the remover is deleting: released once gone

    @property
    def writes(self) -> bool:
        """This rank records consumption and reconciles (rank 0 of a live run)."""
        return self.live and self.rank == 0

    @property
    def deletes(self) -> bool:
        """This rank deletes and releases shards: rank 0, or each node's lowest rank (node-local)."""
        return self.live and (self.node_leader if self.node is not None else self.rank == 0)

    def record(self, step: int, items: list[Consumed]) -> None:
        """Step ``step`` completed using these shards (``items`` from every rank); the manifest
        refuses (raises) before anything is recorded if one of them is not ``written``."""
        if self.writes:
            self.m.consume([c.job for c in items], step, {c.job: c.rank for c in items})
        self.consumed[step] = list(items)

    def holds_unreleased(self, step: int) -> bool:
        """Consumed shards no durable checkpoint covers yet (live runs only)."""
        return self.live and step > self.checkpointed

    def covered(self) -> dict[int, int]:
        """job id -> the step that consumed it."""
        return {c.job: int(step) for step, items in self.consumed.items() for c in items}

    def checkpoint_done(self, step: int) -> None:
        """A checkpoint covering ``step`` is durable: release (or keep) what it covers."""
        self.checkpointed = step
        if self.deletes:
            self.poll(wait=True)  # the previous batch first: its jobs are still consumed until then
            self._release([j.id for j in self.m.consumed_upto(step) if self.node in (None, j.host)])

    def poll(self, wait: bool = False) -> None:
        """Mark the batch being deleted released once its files are gone (``wait``: wait for that)."""
        if not self.deleting or not (wait or self.remover.done()):
            return
        self.remover.wait()
        ids, self.deleting = self.deleting, []
        self.m.release(ids)

    def state_dict(self) -> dict:
        """The record (train.checkpoint.Stateful)."""
        return {"consumed": {str(s): [list(c) for c in v] for s, v in sorted(self.consumed.items())}}

    def load_state_dict(self, state) -> None:
        """The record of a checkpoint at ``state["step"]`` (resume)."""
        self.consumed = read_record(state["consumed"])
        self.checkpointed = int(state["step"])

    def reconcile(self) -> None:
        """Make the manifest agree with the record (resume, rank 0 of a live run); with node-local
        stores also return a lost node's written jobs to extract (its shards are gone with it)."""
        if self.writes:
            covered = self.m.resume_trainer(self.covered())
            if self.node is None:
                self._release(covered)
                return
            requeued, released = self.m.requeue_absent_nodes(list(self.nodes))
            elsewhere = sorted({p.host for p in self.m.live_procs("extract")} - set(self.nodes))
            if elsewhere:  # a node lost moments ago may still look alive until its registration lapses
                print(
                    f"train: warning: extract runs on {', '.join(elsewhere)}, where no rank of this trainer "
                    "runs: with node-local stores its shards are trained by no one; run trainer ranks there, "
                    "or stop it",
                    file=sys.stderr,
                    flush=True,
                )
            if requeued or released:
                print(
                    f"train: {requeued} written job(s) of nodes outside this trainer job "
                    f"({', '.join(self.nodes)}) go back to extract; {released} consumed one(s) are released",
                    file=sys.stderr,
                    flush=True,
                )

    def release_node(self) -> None:
        """Node-local stores, after rank 0 reconciled: release this node's covered shards (its leader)."""
        if self.node is not None and self.deletes:
            self._release([j.id for j in self.m.jobs("consumed") if j.host == self.node])

    def _release(self, job_ids: list[int]) -> None:
        if not job_ids:
            return
        if self.keep_shards:
            self.m.release(job_ids, keep=True)
            return
        self.poll(wait=True)
        self.m.check_fence()  # a trainer another one replaced deletes nothing
        self.store.delete_shards([(j.epoch, j.id) for j in map(self.m.job, job_ids)], self.remover)
        self.deleting = list(job_ids)

    def close(self) -> None:
        """Wait until the released shards' files are gone, and mark them released."""
        self.remover.wait()
        if self.deletes and self.deleting:
            try:
                self.poll(wait=True)
            except DflashError as e:  # the manifest is gone: a resume releases them (reconcile)
                print(f"train: warning: could not mark released shards released: {e}", file=sys.stderr)
