"""A worker's hold on its claims: :class:`Lease` renews the leases of the jobs it holds from a heartbeat
thread, and :class:`Publisher` hands each shard to the background writer and publishes it under its
claim (the rename into place and ``claimed -> written`` in one manifest transaction, only while the
claim holds: a worker that lost its claim never publishes). See :mod:`dflash_staged.extract.worker`."""

from __future__ import annotations

import sys
import threading

import torch

from dflash_staged.errors import DflashError
from dflash_staged.extract.options import ExtractOptions
from dflash_staged.manifest import Job, Manifest
from dflash_staged.store import ShardStore, StoreFullError
from dflash_staged.store.fp8 import quantize


class Lease(threading.Thread):
    """Extends the leases of held jobs (being computed or waiting to be published) every lease_s / 3."""

    def __init__(self, opts: ExtractOptions):
        super().__init__(daemon=True, name="lease")
        self.opts = opts
        self.jobs: dict[int, Job] = {}
        self.lost: set[int] = set()
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def hold(self, job: Job) -> None:
        with self.lock:
            self.jobs[job.id] = job
            self.lost.discard(job.id)

    def drop(self, job: Job) -> None:
        with self.lock:
            self.jobs.pop(job.id, None)

    def is_lost(self, job: Job) -> bool:
        with self.lock:
            return job.id in self.lost

    def held(self) -> list[Job]:
        with self.lock:
            return list(self.jobs.values())

    def start(self) -> None:
        self._m = Manifest.open(self.opts.manifest)  # here, so that a bad manifest fails the worker's start
        super().start()

    def run(self) -> None:
        m = self._m
        try:
            while not self.stop.wait(max(0.05, self.opts.lease_s / 3)):
                for job in self.held():
                    if not m.extend_lease(job, self.opts.lease_s):
                        with self.lock:
                            self.lost.add(job.id)
        except DflashError:  # the manifest is gone for good (its server, for longer than the retry bound)
            with self.lock:
                self.lost.update(self.jobs)
        finally:
            m.close()


class Publisher:
    """Hands shards to the background writer and publishes each one under its claim when staged."""

    def __init__(self, opts: ExtractOptions, store: ShardStore, lease: Lease, max_pending: int = 1):
        from dflash_staged.extract.writer import ShardWriter

        self.opts, self.store, self.lease = opts, store, lease
        self.writer = ShardWriter(store, max_pending=max_pending, stage_only=True)
        self._m = Manifest.open(
            opts.manifest
        )  # the writer thread's own handle (opened now: it may not open later)

    @property
    def error(self) -> BaseException | None:
        return self.writer.error

    def submit(
        self, job: Job, hidden: torch.Tensor, input_ids, loss_mask, cu_seqlens, sample_ids, topk=None
    ) -> None:
        """Queue one job's shard. In an FP8 store the states are quantized here, on the target's device,
        so that the copy off it is one byte a value."""
        if self.writer.error is not None:
            raise self.writer.error
        hidden_scale = None
        if self.store.meta.fp8:
            hidden, hidden_scale = quantize(hidden)
        if topk is not None and not self.store.meta.topk_tail:  # a store begun before the tail was kept
            topk = topk[:2]
        self.writer.submit(
            job.epoch,
            job.id,
            hidden,
            input_ids,
            loss_mask,
            cu_seqlens,
            sample_ids,
            on_done=lambda result, job=job: self._done(job, result),
            topk=topk,
            hidden_scale=hidden_scale,
        )

    def _done(self, job: Job, result) -> None:  # runs on the writer thread
        try:
            if isinstance(result, StoreFullError):
                self._m.give_back(job, f"disk full: {result}")
            elif isinstance(result, BaseException):
                self._m.fail(job, f"write failed: {type(result).__name__}: {result}", self.opts.max_attempts)
            elif not self._m.publish(
                job, result.info.nbytes, result.info.checksum, commit=lambda: self.store.commit_staged(result)
            ):
                self.store.discard_staged(result)  # the claim was lost: never publish
                print(
                    f"extract: job {job.id}: this worker's claim was lost (lease expired, the job went to "
                    "another worker); its shard was discarded",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            self.lease.drop(job)

    def close(self) -> None:
        """Wait for every submitted shard; re-raise the first write error."""
        try:
            self.writer.close()
        finally:
            self._m.close()
