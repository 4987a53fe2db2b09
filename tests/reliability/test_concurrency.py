"""Concurrency: 8 `dflash extract` processes on one manifest; two trainers on one manifest.

The extract processes use a fast fake target (hooks/dflash_fault_hooks.py) whose hidden states
are a known function of the token ids, and log every shard they publish; a consumer in the test
verifies and retires shards as they appear (state `kept`, outside the window), so the window
(smaller than the job count) is exercised by 8 concurrent claimers.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from dflash_staged.manifest import Manifest, TrainerBusyError
from dflash_staged.store import ShardStore

from dflash_fault_hooks import expected_hidden  # on sys.path via conftest.py
from helpers import ROOT, plan, run, start
from pgcluster import PG_SLOW
from rel_helpers import hooked_env

WINDOW = 12
HIDDEN = 8


EXTRA = "[data]\ntoken_budget = 512\n"


def check_shard(store: ShardStore, m: Manifest, job) -> None:
    shard = store.read_shard(job.epoch, job.id, job.checksum)
    assert shard.sample_ids.tolist() == job.sample_ids
    ids = torch.cat([torch.from_numpy(m.sample(s)[0].astype("int64")) for s in job.sample_ids])
    assert torch.equal(shard.input_ids.long(), ids)
    assert torch.equal(shard.hidden, expected_hidden(ids, len(m.meta["layer_ids"]), HIDDEN))


@pytest.mark.slow  # the default suite's 12 minutes (issue 50); CI runs it (.ci/run)
@pytest.mark.parametrize(
    "backend", PG_SLOW, indirect=True
)  # default suite: test_manifest's 8 claimers, test_multihost
def test_eight_extract_processes_write_every_job_exactly_once(tmp_path, backend):
    mdir, store_dir = (
        plan(tmp_path, n=160, epochs=2, extra=EXTRA, manifest=backend.address(tmp_path)),
        tmp_path / "store",
    )
    log = tmp_path / "commits.log"
    environ = hooked_env(fake_target={"hidden": HIDDEN, "delay_s": 0.05}, commit_log=str(log))
    procs = [
        start(
            ["extract", "--manifest", mdir, "--store", store_dir, "--devices", "cpu", "--window", WINDOW],
            tmp_path / f"extract{i}.log",
            environ,
        )
        for i in range(8)
    ]
    m = Manifest.open(mdir)
    total = sum(m.counts().values())
    assert total > 3 * WINDOW
    windows, retired = [], 0
    store = None
    t0 = time.time()
    try:
        while any(p.poll() is None for p in procs):
            assert time.time() - t0 < 400, "extract processes did not finish"
            windows.append(m.window()["shards"])
            written = m.jobs("written")
            if written and store is None:
                store = ShardStore.open(store_dir)
            for j in written:  # a consumer: verify, then retire out of the window
                check_shard(store, m, j)
                m.consume([j.id], step=0)
                m.release([j.id], keep=True)
                retired += 1
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        out = (tmp_path / f"extract{i}.log").read_text()
        assert p.returncode == 0 and "Traceback" not in out, out[-2000:]
    for j in m.jobs("written"):
        check_shard(store, m, j)
    commits = [tuple(map(int, x.split())) for x in log.read_text().splitlines()]
    per_job = Counter(job for job, _ in commits)
    assert sorted(per_job) == sorted(j.id for j in m.jobs()), "a job was never published"
    assert set(per_job.values()) == {1}, f"jobs published twice: {[j for j, n in per_job.items() if n > 1]}"
    assert len({pid for _, pid in commits}) >= 2, "only one worker did any work"
    assert all(j.attempts == 1 for j in m.jobs()), "a job was claimed twice"
    assert not m.events("reclaim") and not m.events("error")
    assert max(windows) <= WINDOW
    assert m.counts()["pending"] == m.counts()["claimed"] == 0
    m.close()


# ---------------------------------------------------------------------------------------------- trainers
def test_second_trainer_refused_naming_the_first(tmp_path, backend):
    mdir = plan(tmp_path, n=12, epochs=1, extra=EXTRA, manifest=backend.address(tmp_path))
    store = tmp_path / "no-store-yet"  # the first trainer registers, then waits for the store
    a = start(["train", "--manifest", mdir, "--store", store, "--out", tmp_path / "a"], tmp_path / "a.log")
    m = Manifest.open(mdir, readonly=True)
    try:
        t0 = time.time()
        while not m.live_procs("train"):
            assert a.poll() is None, (tmp_path / "a.log").read_text()
            assert time.time() - t0 < 120, "the first trainer never registered"
            time.sleep(0.1)
        r = run(["train", "--manifest", mdir, "--store", store, "--out", tmp_path / "b"])
        out = r.stdout + r.stderr
        assert r.returncode == 1 and "Traceback" not in out, out
        line = [x for x in out.splitlines() if x.startswith("error:")]
        assert line and f"pid {a.pid}" in line[0] and socket.gethostname() in line[0], out
        assert "DDP" in line[0]
        assert a.poll() is None, "the first trainer was disturbed"
        a.send_signal(signal.SIGKILL)  # a dead trainer's registration does not block the next one
        a.wait()
        b = start(
            ["train", "--manifest", mdir, "--store", store, "--out", tmp_path / "b"], tmp_path / "b.log"
        )
        try:
            t0 = time.time()
            while not [p for p in m.live_procs("train") if p.pid == b.pid]:
                assert b.poll() is None, (tmp_path / "b.log").read_text()
                assert time.time() - t0 < 120, "the second trainer never registered"
                time.sleep(0.1)
        finally:
            b.kill()
            b.wait()
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
        m.close()


HOLDER = """
import sys, time
from dflash_staged.manifest import Manifest
m = Manifest.open(sys.argv[1])
m.register("train", group_id=sys.argv[2], rank=0, exclusive=True)
print("registered", flush=True)
time.sleep(600)
"""


def test_ranks_of_one_ddp_job_share_the_manifest(tmp_path):
    mdir = plan(tmp_path, n=12, epochs=1, extra=EXTRA)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(mdir), "job-1"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "registered"
        with Manifest.open(mdir) as m:
            m.register("train", group_id="job-1", rank=1, exclusive=True)  # same DDP job: accepted
            with pytest.raises(TrainerBusyError, match=rf"host {socket.gethostname()}, pid {holder.pid}"):
                m.register("train", group_id="job-2", rank=0, exclusive=True)
            assert sorted(p.rank for p in m.live_procs("train")) == [0, 1]
    finally:
        holder.kill()
        holder.wait()
