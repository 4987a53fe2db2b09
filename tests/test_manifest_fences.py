"""The manifest's fences (issue 22): a job is held by one rank and consumed once, a claim belongs to
one process on one host, a replaced trainer stops (and its open transaction finishes before its
successor reconciles), and no shard of a job that should have none survives the store's cleanup."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from test_manifest import make

from dflash_staged.manifest import Manifest, ManifestError
from dflash_staged.manifest.postgres import procs as pg_procs
from dflash_staged.store import ShardStore, StoreMeta


@pytest.fixture
def at(backend, tmp_path):
    made: dict = {}
    return lambda name: made.setdefault(name, backend.address(tmp_path, name))


def written(m: Manifest, n: int, store: ShardStore | None = None) -> list[int]:
    """Claim and publish ``n`` jobs (with a real shard in ``store`` if given); their ids, in order."""
    ids = []
    for _ in range(n):
        j = m.claim("w", window=100).job
        commit = None
        if store is not None:
            hidden = torch.zeros(j.real_tokens, 1, 4)
            staged = store.stage_shard(
                j.epoch,
                j.id,
                hidden,
                torch.arange(j.real_tokens),
                torch.ones(j.real_tokens, dtype=torch.uint8),
                [0, j.real_tokens],
                [j.sample_ids[0]],
            )
            commit = lambda staged=staged: store.commit_staged(staged)  # noqa: E731
        assert m.publish(j, 10, "c", commit=commit)
        ids.append(j.id)
    return ids


# ------------------------------------------------------------------------------------------ take / retake
def test_retake_never_takes_a_job_another_rank_holds(at):
    """Regression: after a trainer restart, a rank's retake took jobs another rank had just taken,
    so two ranks' buffers held the same job."""
    m = make(at)
    ids = written(m, 6)
    assert [j.id for j in m.take("T", 1, 2)] == ids[:2]
    assert [j.id for j in m.take("T", 0, 2)] == ids[2:4]
    m.resume_trainer({})  # the restart: every taken mark cleared
    assert [j.id for j in m.retake("T", 0, ids[2:4])] == ids[2:4]
    assert [j.id for j in m.take("T", 0, 2)] == ids[:2]  # rank 1's checkpointed jobs, untaken now
    assert m.retake("T", 1, ids[:2]) == []  # rank 0 holds them
    assert m.retake("U", 0, ids[:2]) == []  # another trainer id neither
    assert [(m.job(i).taken_by, m.job(i).rank) for i in ids[:4]] == [("T", 0)] * 4
    # its own again, and a free one
    assert [j.id for j in m.retake("T", 0, [ids[1], ids[4]])] == [ids[1], ids[4]]


# ---------------------------------------------------------------------------------------------- consume
def test_consume_is_all_or_nothing(at):
    m = make(at)
    ids = written(m, 5)
    m.take("T", 0, 2)  # ids[0], ids[1] taken by rank 0; the rest by no one
    m.consume([ids[0]], step=1, rank_of={ids[0]: 0})
    with pytest.raises(ManifestError, match=rf"step 2 cannot consume: job {ids[0]} is consumed.*nothing"):
        m.consume([ids[2], ids[0]], step=2)
    with pytest.raises(ManifestError, match=rf"job {ids[1]} is written, taken by 'T' rank 0 \(consumed as"):
        m.consume([ids[3], ids[1]], step=2, rank_of={ids[3]: 1, ids[1]: 1})
    with pytest.raises(ManifestError, match=rf"jobs \[{ids[4]}\]: each is listed more than once"):
        m.consume([ids[4], ids[4]], step=2)
    assert [m.job(i).state for i in ids] == ["consumed"] + ["written"] * 4  # the refusals changed nothing
    m.consume(ids[1:], step=2, rank_of={ids[1]: 0, ids[2]: 1})
    assert [(m.job(i).state, m.job(i).step) for i in ids] == [("consumed", 1)] + [("consumed", 2)] * 4
    assert m.job(ids[2]).rank == 1


# ---------------------------------------------------------------------------------------------- claims
@pytest.mark.parametrize("field", ["host", "pid_start", "boot_id"])
def test_a_claim_belongs_to_its_process_on_its_host(at, field):
    """Regression: ownership compared (state, worker, attempts) only, and worker ids (w{rank}-{pid})
    repeat across hosts and containers."""
    m = make(at)
    job = m.claim("w0-7", window=10).job
    if field == "boot_id" and job.boot_id is None:
        pytest.skip("this backend records no boot id")
    assert job.host is not None and job.pid is not None and job.pid_start is not None
    twin = dataclasses.replace(job, **{field: "other" if field != "pid_start" else job.pid_start + 1})
    assert not m.extend_lease(twin, 60)
    assert not m.publish(twin, 1, "x", commit=lambda: pytest.fail("renamed"))
    assert not m.give_back(twin) and m.fail(twin, "boom", max_attempts=1) is None
    assert m.job(job.id).state == "claimed"
    assert m.extend_lease(job, 60) and m.publish(job, 1, "x")


# ---------------------------------------------------------------------------------------------- the fence
def test_check_fence_without_a_replacement_is_a_no_op(at):
    m = make(at)
    m.check_fence()  # no registration
    m.register("train", group_id="A", rank=0, exclusive=True)
    m.check_fence()
    m.close()


def test_check_fence_raises_once_another_trainer_replaced_this_one(tmp_path, pg):
    m = make(lambda _: pg.url())
    a, b = Manifest.open(m.address), m
    me = a.register("train", group_id="A", rank=0, exclusive=True)
    a.check_fence()
    b.unregister(me)  # what another trainer's register does to a registration whose heartbeat lapsed
    with pytest.raises(ManifestError, match="registration .* lapsed"):
        a.check_fence()
    a.close()
    b.close()


def test_a_new_trainer_waits_for_the_replaced_ones_open_transaction(tmp_path, pg, monkeypatch):
    """Regression: the fence was a plain SELECT, so a new trainer could register and reconcile while
    the old one's consume was still open; that consume then committed after the reconcile, and the
    new trainer released jobs it never trained."""
    b = make(lambda _: pg.url())
    ids = written(b, 4)
    a = Manifest.open(b.address)
    me = a.register("train", group_id="A", rank=0, exclusive=True)
    assert [j.id for j in a.take("A", 0, 2)] == ids[:2]
    inside, go = threading.Event(), threading.Event()
    real = a._procs.check_fence

    def check_then_wait(cur):  # A's consume: fence checked, then stalled before its update
        real(cur)
        inside.set()
        assert go.wait(30)

    monkeypatch.setattr(a._procs, "check_fence", check_then_wait)
    ta = threading.Thread(target=lambda: a.consume(ids[:2], step=1, rank_of={ids[0]: 0, ids[1]: 0}))
    ta.start()
    assert inside.wait(30)
    # B: another process of this host whose look at A's registration finds it lapsed
    host, pid, start = pg_procs.my_identity()
    monkeypatch.setattr(pg_procs, "my_identity", lambda: (host, pid, start + 1))
    monkeypatch.setattr(pg_procs, "alive", lambda p, now, lease: p["id"] != me)
    registered, got = threading.Event(), {}

    def trainer_b():
        b.register("train", group_id="B", rank=0, exclusive=True)
        registered.set()
        got["release"] = b.resume_trainer({})  # B's checkpoint covers nothing

    tb = threading.Thread(target=trainer_b)
    tb.start()
    try:
        assert not registered.wait(1.5), "B registered while A's fenced transaction was open"
    finally:
        go.set()
        ta.join(30)
        tb.join(30)
    assert registered.is_set() and got["release"] == []
    assert [b.job(i).state for i in ids] == ["written"] * 4  # A's consume, committed first, was reverted
    with pytest.raises(ManifestError, match="lapsed"):
        a.check_fence()
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------- stale shards
def test_cleanup_deletes_shards_of_jobs_that_should_have_none(at, tmp_path):
    """Regression: a shard renamed into place after its job was released (or requeued) stayed for good."""
    m = make(at)
    store = ShardStore.create_or_open(
        tmp_path / "store",
        StoreMeta(
            manifest_id=m.manifest_id, target_id="t", layer_ids=[1], hidden_size=4, logical_dtype="float32"
        ),
    )
    ids = written(m, 4, store)
    jobs = {i: m.job(i) for i in ids}
    m.consume(ids[:2], step=1)
    m.release(ids[:1])  # ids[0] released, but its shard is still on disk (a late rename)
    assert m.requeue(ids[2], "corrupt")  # ids[2] pending, its old shard still on disk
    pending = m.claim("w", window=100).job  # ids[2] again: claimed, its old shard stays until it publishes
    assert pending.id == ids[2]
    assert store.cleanup_temp(claimed=m.holds_claim, unwanted=m.shard_unwanted) == 1
    assert sorted(store.iter_shards()) == sorted((jobs[i].epoch, i) for i in ids[1:])
    assert m.give_back(pending)  # pending now
    assert store.cleanup_temp(unwanted=m.shard_unwanted) == 1
    assert sorted(store.iter_shards()) == sorted((jobs[i].epoch, i) for i in (ids[1], ids[3]))
    assert [
        p.name for p in (store.root / "shards" / f"e{jobs[ids[0]].epoch}").iterdir() if p.name.startswith(".")
    ] == []  # deleted through delete_shard, nothing left behind
    m.close()
