"""Manifest state machine: claims, leases, dead-pid reclaim, failures, window, trainer resume."""

import multiprocessing as mp
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_staged.config import Config
from dflash_staged.manifest import Manifest, ManifestError, ManifestMismatchError, TrainerBusyError


def fake_inputs(n_batches=6, epochs=1, per_batch=2, seed=0):
    n = n_batches * per_batch
    lengths = np.full(n, 8)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    samples = SimpleNamespace(
        tokens=np.arange(offsets[-1], dtype=np.int32) % 100 + 4,
        loss_mask=np.ones(offsets[-1], np.uint8),
        offsets=offsets,
        stats={"samples": n},
    )
    batches = [(b % 2, list(range(b * per_batch, (b + 1) * per_batch))) for b in range(n_batches)]

    def jobs():
        for e in range(epochs):
            order = np.random.default_rng([seed, e]).permutation(n_batches)
            for pos, bi in enumerate(order):
                bucket, ids = batches[bi]
                yield SimpleNamespace(
                    epoch=e, pos=pos, bucket=bucket, sample_ids=ids, real_tokens=16, padded_tokens=16
                )

    plan = SimpleNamespace(
        edges=[8, 16],
        epochs=epochs,
        seed=seed,
        batches=batches,
        jobs=jobs,
        padding_waste=0.0,
        tokens_real=n * 8,
        tokens_padded=n * 8,
    )
    return samples, plan


def make(at, name="m", **kw):
    """A manifest at ``at`` (a directory's parent, or a backend's address maker)."""
    samples, plan = fake_inputs(**kw)
    address = at(name) if callable(at) else at / name
    return Manifest.create(
        address, config=Config(), samples=samples, plan=plan, data_path="d.jsonl", data_hash="h"
    )


@pytest.fixture
def at(backend, tmp_path):
    """Where the parametrized backend puts a manifest named ``name`` (the same address for the same name)."""
    made: dict = {}
    return lambda name: made.setdefault(name, backend.address(tmp_path, name))


def test_create_is_atomic_and_idempotent(at, tmp_path):
    m = make(at, n_batches=5, epochs=2)
    assert m.counts()["pending"] == 10
    assert sorted(j.id for j in m.jobs()) == list(range(10))
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    again = make(at, n_batches=5, epochs=2)
    assert again.manifest_id == m.manifest_id
    samples, plan = fake_inputs(n_batches=5, epochs=2)
    cfg = Config()
    cfg.data.max_len = 1024
    with pytest.raises(ManifestMismatchError, match="data.max_len"):
        Manifest.create(at("m"), config=cfg, samples=samples, plan=plan, data_path="d", data_hash="h")
    tok, mask = m.sample(3)
    assert tok.dtype == np.int32 and len(tok) == 8 and mask.all()


def test_claim_order_window_and_publish(at, tmp_path):
    m = make(at, n_batches=4, epochs=2)
    got = []
    for _ in range(3):
        r = m.claim("w0", window=3)
        got.append(r.job)
    assert [(j.epoch, j.pos) for j in got] == [(0, 0), (0, 1), (0, 2)]
    r = m.claim("w0", window=3)
    assert r.job is None and r.window_full and r.window["shards"] == 3
    assert m.publish(got[0], 100, "abc")
    assert m.window() == {"shards": 3, "bytes": 100}
    assert not m.publish(got[0], 100, "abc")  # no longer claimed
    m.take("t", 0, 5)
    m.consume([got[0].id], step=1)
    m.release([got[0].id])
    assert m.window()["shards"] == 2
    assert m.claim("w0", window=3).job.pos == 3
    assert not m.extract_done()


def test_lost_claim_cannot_publish(at, tmp_path):
    m = make(at)
    j = m.claim("w0", window=10, lease_s=0.01).job
    time.sleep(0.05)
    j2 = m.claim("w1", window=10).job  # reclaims the expired lease first, in manifest order
    assert j2.id == j.id and j2.attempts == 2
    assert not m.publish(j, 1, "x") and not m.extend_lease(j, 10)
    assert m.publish(j2, 1, "x")
    assert any(e["kind"] == "reclaim" for e in m.events())


def test_dead_pid_is_reclaimed_at_once(at, tmp_path):
    m = make(at)
    code = (
        "import sys; from dflash_staged.manifest import Manifest; m = Manifest.open(sys.argv[1]);"
        "print(m.claim('dead', window=10, lease_s=3600).job.id, flush=True)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(m.address)], capture_output=True, text=True, check=True
    )
    dead_job = int(out.stdout)
    assert m.counts()["claimed"] == 1
    r = m.claim("alive", window=10)
    assert r.job.id == dead_job


def test_failed_after_max_attempts_and_abandon(at, tmp_path):
    m = make(at, n_batches=2)
    for i in range(3):
        j = m.claim("w", window=10).job
        assert j.id == 0
        state = m.fail(j, f"boom {i}", max_attempts=3)
    assert state == "failed"
    assert m.job(0).state == "failed"
    j = m.claim("w", window=10).job
    assert j.id == 1 and m.give_back(j)
    assert m.job(1).state == "pending"
    st = m.status()
    assert st["failed"][0]["error"] == "boom 2"
    assert set(st["jobs"]) == {"pending", "claimed", "written", "consumed", "released", "kept", "failed"}


def _claimer(path, out_q):
    m = Manifest.open(path)
    mine = []
    while True:
        r = m.claim(f"p{os.getpid()}", window=10**9)
        if r.job is None:
            break
        assert m.publish(r.job, 1, "c")
        mine.append(r.job.id)
    out_q.put(mine)


def test_eight_processes_claim_each_job_once(at, tmp_path):
    m = make(at, n_batches=50, epochs=2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(str(m.address), q)) for _ in range(8)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    flat = [i for r in results for i in r]
    assert sorted(flat) == list(range(100))
    assert m.counts()["written"] == 100 and m.extract_done()


def test_requeue_and_resume_trainer(at, tmp_path):
    m = make(at, n_batches=6)
    jobs = []
    for _ in range(6):
        j = m.claim("w", window=10).job
        m.publish(j, 10, "c")
        jobs.append(j)
    assert m.extract_done()
    taken = m.take("T", 0, 4)
    assert [j.id for j in taken] == [j.id for j in jobs[:4]]
    m.consume([jobs[0].id, jobs[1].id], step=1)
    m.consume([jobs[2].id, jobs[3].id], step=2)
    assert m.requeue(jobs[4].id, "corrupt: checksum mismatch")
    assert not m.extract_done() and m.job(jobs[4].id).state == "pending"
    # checkpoint covers step 1 only: step 2's jobs go back to written
    to_release = m.resume_trainer({jobs[0].id: 1, jobs[1].id: 1})
    assert to_release == sorted([jobs[0].id, jobs[1].id])
    assert m.job(jobs[2].id).state == "written" and m.job(jobs[2].id).taken_by is None
    m.release(to_release, keep=True)
    c = m.counts()
    assert c["kept"] == 2 and c["written"] == 3 and c["pending"] == 1
    assert m.status()["requeued"] == {"corrupt": 1}


def test_second_trainer_refused(at, tmp_path):
    m = make(at)
    code = (
        "import sys, time; from dflash_staged.manifest import Manifest; m = Manifest.open(sys.argv[1]);"
        "m.register('train', group_id='A', exclusive=True); print('ok', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(m.address)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ok"
        with pytest.raises(TrainerBusyError, match=f"pid {p.pid}"):
            m.register("train", group_id="B", exclusive=True)
        m.register("train", group_id="A", exclusive=True)  # a rank of the same DDP job is fine
    finally:
        p.kill()
        p.wait()
    m.register("train", group_id="B", exclusive=True)  # the first one is dead now


def test_another_format_version_is_refused_on_open(at, tmp_path):
    m = make(at)
    m.set_meta("format_version", 99)  # a manifest written by a later version
    m.close()
    with pytest.raises(ManifestError, match="format_version 99"):
        Manifest.open(at("m"))


def test_paths_with_hash_and_question_marks_are_plain_paths(tmp_path):
    # SQLite URIs end the path at '#' or '?'; the manifest must open such a directory as it is
    m = make(tmp_path, name="run#1?x")
    m.close()
    for readonly in (False, True):
        with Manifest.open(tmp_path / "run#1?x", readonly=readonly) as m2:
            assert m2.counts()["pending"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run#1?x"]


def test_sqlite_claims_skip_the_fsync_and_every_other_commit_keeps_it(tmp_path):
    """Claims, lease extensions and consumes commit without an fsync (a power loss takes their
    processes too); the handle is back to synchronous=FULL after each, even one that raised."""
    from dflash_staged.errors import DflashError

    m = make(tmp_path)
    assert m.synchronous() == 2  # FULL
    r = m.claim("w0", window=8)
    assert r.job is not None and m.synchronous() == 2
    with pytest.raises(DflashError):
        m.consume([r.job.id], step=1)  # claimed, not written: refused, rolled back
    assert m.synchronous() == 2 and m.counts()["claimed"] == 1
