"""Extract's worker parts in this process: the heartbeat (:class:`Lease`) and the publisher
(:class:`Publisher`), against a real SQLite manifest, a real shard store and the tiny target."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from dflash_staged.errors import DflashError
from dflash_staged.extract.worker import Lease, Publisher, batch_tensors
from dflash_staged.model.target import pack_unpadded
from dflash_staged.store import StoreFullError

from helpers import extract_world, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture
def world(tmp_path, target):
    """A planned manifest (12 samples, several jobs), its store, and the options of a worker."""
    m, store, opts = extract_world(tmp_path, target, lease_s=0.6)
    started: list[Lease] = []

    def lease(lease_s: float = 0.6, start: bool = True) -> Lease:
        opts.lease_s = lease_s
        lz = Lease(opts)
        if start:
            lz.start()
            started.append(lz)
        return lz

    def shard(job):
        """What a worker hands the publisher for ``job``: the target's hidden states, packed."""
        ids, attn, lengths, packed_ids, loss_mask, cu, sample_ids = batch_tensors(m, job)
        with torch.no_grad():
            hidden = pack_unpadded(target.capture(ids, attn), lengths)
        return hidden, packed_ids, loss_mask, cu, sample_ids

    yield SimpleNamespace(m=m, store=store, opts=opts, lease=lease, shard=shard)
    for lz in started:
        lz.stop.set()
        lz.join(timeout=5)
    m.close()


def temp_dirs(store) -> list:
    return [p for p in store.root.rglob("*") if ".tmp~" in p.name]


def lose(m, job, winner: str = "w1"):
    """Let ``job``'s claim expire and have another worker retake it; the winner's claim."""
    time.sleep(max(0.0, m.job(job.id).lease_until - time.time()) + 0.05)
    r = m.claim(winner, window=64, lease_s=60)
    assert r.job is not None and r.job.id == job.id and r.job.worker == winner
    return r.job


def wait_for(cond, timeout: float = 10.0) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# ---------------------------------------------------------------------------------------------- Lease


def test_lease_extends_held_claims_until_dropped_or_stopped(world):
    m = world.m
    lease = world.lease(lease_s=1.5)  # a beat every 0.5 s
    a = m.claim("w0", window=64, lease_s=1.5).job
    b = m.claim("w0", window=64, lease_s=1.5).job
    lease.hold(a)
    lease.hold(b)
    assert sorted(j.id for j in lease.held()) == [a.id, b.id]
    time.sleep(max(0.0, max(a.lease_until, b.lease_until) - time.time()) + 0.3)  # past the claims' own lease
    now = time.time()
    for j in (a, b):
        got = m.job(j.id)
        assert got.state == "claimed" and got.worker == "w0"
        assert got.lease_until > j.lease_until and got.lease_until > now  # extended, not expired
        assert not lease.is_lost(j)
    assert m.claim("w1", window=64, lease_s=60).job.id not in (a.id, b.id)  # neither reclaimed as stale
    lease.drop(b)  # a dropped claim is no longer extended: it expires and goes to another worker
    assert [j.id for j in lease.held()] == [a.id]
    time.sleep(0.7)  # a beat that had already read the held claims is over
    assert lose(m, b).id == b.id
    assert not lease.is_lost(b)  # dropped before it was lost: not reported
    lease.stop.set()
    lease.join(timeout=5)
    assert not lease.is_alive()
    until = m.job(a.id).lease_until
    time.sleep(0.7)
    assert m.job(a.id).lease_until == until  # stopped: no more beats
    assert not lease.is_lost(a)


def test_lease_reports_a_claim_another_worker_retook(world):
    m = world.m
    lease = world.lease(lease_s=0.6)
    mine = m.claim("w0", window=64, lease_s=0.05).job  # expires before the first beat
    kept = m.claim("w0", window=64, lease_s=60).job
    theirs = lose(m, mine)
    lease.hold(mine)
    lease.hold(kept)
    assert wait_for(lambda: lease.is_lost(mine))
    assert not lease.is_lost(kept)
    assert m.job(mine.id).worker == theirs.worker  # the loser's beats never take the claim back
    assert m.job(mine.id).lease_until == theirs.lease_until
    lease.stop.set()
    lease.join(timeout=5)
    lease.hold(mine)  # holding it again (a new claim of the same job) clears the loss
    assert not lease.is_lost(mine)


def test_lease_with_the_manifest_gone_reports_every_held_claim_lost(world, monkeypatch):
    m = world.m
    lease = world.lease(lease_s=0.6)
    jobs = [m.claim("w0", window=64, lease_s=60).job for _ in range(2)]
    for j in jobs:
        lease.hold(j)

    def gone(self, job, lease_s):
        raise DflashError("the manifest server is unreachable")

    monkeypatch.setattr(type(m), "extend_lease", gone)
    assert wait_for(lambda: all(lease.is_lost(j) for j in jobs))
    lease.join(timeout=5)
    assert not lease.is_alive()  # it stops beating by itself


def test_lease_start_fails_on_a_missing_manifest(world, tmp_path):
    world.opts.manifest = tmp_path / "no-such-manifest"
    lease = Lease(world.opts)
    with pytest.raises(DflashError):
        lease.start()
    assert not lease.is_alive()


# ------------------------------------------------------------------------------------------ Publisher


def test_publish_makes_the_shard_readable_and_the_job_written_once(world):
    m, store = world.m, world.store
    lease = world.lease(lease_s=30)
    jobs = [m.claim("w0", window=64, lease_s=30).job for _ in range(2)]
    pub = Publisher(world.opts, store, lease)
    sent = {}
    for j in jobs:
        lease.hold(j)
        sent[j.id] = world.shard(j)
        pub.submit(j, *sent[j.id])
    pub.close()
    assert pub.error is None and lease.held() == []  # published claims leave the heartbeat
    assert m.counts()["written"] == 2
    for j in jobs:
        got = m.job(j.id)
        assert got.state == "written" and got.lease_until is None
        assert got.checksum == store.read_attrs(j.epoch, j.id)["checksum"]
        assert got.shard_bytes == store.read_attrs(j.epoch, j.id)["nbytes"]
        shard = store.read_shard(j.epoch, j.id, got.checksum)
        hidden, ids, mask, cu, sids = sent[j.id]
        assert torch.equal(shard.hidden, hidden) and torch.equal(shard.input_ids.long(), ids.long())
        assert torch.equal(shard.loss_mask.bool(), mask.bool()) and torch.equal(shard.cu_seqlens, cu)
        assert shard.sample_ids.tolist() == j.sample_ids == sids.tolist()
        assert not m.publish(j, 1, "x")  # written once: the claim is spent
    assert sorted(store.iter_shards()) == sorted((j.epoch, j.id) for j in jobs)
    assert temp_dirs(store) == []
    with pytest.raises(RuntimeError):
        pub.submit(jobs[0], *sent[jobs[0].id])  # closed


def test_a_lost_claim_publishes_nothing_and_keeps_the_newer_shard(world):
    m, store = world.m, world.store
    lease = world.lease(lease_s=0.6)
    mine = m.claim("w0", window=64, lease_s=0.05).job
    theirs = lose(m, mine)  # before this worker's first beat
    lease.hold(mine)
    assert wait_for(lambda: lease.is_lost(mine))
    late = Publisher(world.opts, store, lease)
    hidden, ids, mask, cu, sids = world.shard(mine)
    late.submit(mine, hidden.clone(), ids, mask, cu, sids)
    late.close()  # a lost claim is not an error
    assert lease.held() == []
    assert not store.has_shard(mine.epoch, mine.id) and temp_dirs(store) == []
    got = m.job(mine.id)
    assert (got.state, got.worker, got.attempts) == ("claimed", "w1", theirs.attempts)  # still the winner's
    assert m.counts()["written"] == 0
    # the winner publishes; the loser, arriving later, must not replace that shard
    winner = Publisher(world.opts, store, world.lease(start=False))
    winner.submit(theirs, hidden, ids, mask, cu, sids)
    winner.close()
    written = m.job(mine.id)
    assert written.state == "written" and m.counts()["written"] == 1
    late = Publisher(world.opts, store, lease)
    late.submit(mine, torch.zeros_like(hidden), ids, mask, cu, sids)
    late.close()
    assert m.job(mine.id).checksum == written.checksum
    assert torch.equal(store.read_shard(mine.epoch, mine.id, written.checksum).hidden, hidden)
    assert temp_dirs(store) == []


def test_a_write_error_fails_the_job_and_stops_the_publisher(world, monkeypatch):
    m, store = world.m, world.store
    world.opts.max_attempts = 1
    lease = world.lease(lease_s=30)
    job = m.claim("w0", window=64, lease_s=30).job
    lease.hold(job)

    def broken(*a, **kw):
        raise OSError("boom: the disk went away")

    monkeypatch.setattr(store, "stage_shard", broken)
    pub = Publisher(world.opts, store, lease)
    pub.submit(job, *world.shard(job))
    with pytest.raises(OSError, match="boom"):
        pub.close()
    assert isinstance(pub.error, OSError) and lease.held() == []
    assert m.job(job.id).state == "failed"  # max_attempts = 1
    assert [e for _, e in m.failed_errors()] and "boom" in m.failed_errors()[0][1]
    with pytest.raises(OSError, match="boom"):  # later shards are refused with the first error
        pub.submit(job, *world.shard(job))
    assert not store.has_shard(job.epoch, job.id)


def test_a_full_disk_gives_the_job_back_without_counting_an_error(world, monkeypatch):
    m, store = world.m, world.store
    world.opts.max_attempts = 1
    lease = world.lease(lease_s=30)
    job = m.claim("w0", window=64, lease_s=30).job
    lease.hold(job)

    def full(*a, **kw):
        raise StoreFullError("no space left")

    monkeypatch.setattr(store, "stage_shard", full)
    pub = Publisher(world.opts, store, lease)
    pub.submit(job, *world.shard(job))
    with pytest.raises(StoreFullError):
        pub.close()
    got = m.job(job.id)
    assert got.state == "pending" and got.worker is None  # back for anyone, not failed at max_attempts = 1
    assert m.failed_errors() == [] and lease.held() == []
    monkeypatch.undo()
    again = m.claim("w0", window=64, lease_s=30).job  # and it can be claimed and published again
    assert again.id == job.id
    lease.hold(again)
    pub = Publisher(world.opts, store, lease)
    pub.submit(again, *world.shard(again))
    pub.close()
    assert m.job(job.id).state == "written" and store.has_shard(job.epoch, job.id)
