"""Tensor-parallel extract workers for real: two CPU processes under gloo holding one tiny target.

* a TP=2 worker and the trainer side by side (``dflash pipeline --tp 2``) complete a run with
  exactly-once accounting, and the kept shards equal a single-process (TP=1) forward of the same
  batches (dense ``tiny:qwen3``);
* ``kill -9`` of the follower mid-run: the supervisor stops the whole group at once, the job goes
  back to pending without counting as an error (given back by the leader, or reclaimed from its
  dead pid: never by lease expiry), the group is restarted and the run completes, no process is
  left behind, and every shard equals the TP=1 forward (MoE ``tiny:qwen3_moe``);
* a forward that raises on one rank only (the fault hook ``forward_error``: out of memory on the
  leader, an error on a follower) ends that process at once, with no further collective: the
  group is restarted long before any collective timeout (set far beyond the test's own) and the
  run completes; the leader's own out-of-memory counts an attempt on the job, with the message
  naming the setting to lower.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter

import psutil
import pytest
import torch

from dflash_staged.manifest import Manifest
from dflash_staged.model.target import load_target, pack_unpadded, pad_batch
from dflash_staged.store import ShardStore

from helpers import dflash, plan, run, run_dflash, write_config, write_dataset
from rel_helpers import assert_exactly_once, hooked_env, scan_store

EXTRA = "[data]\ntoken_budget = 512\n"


def assert_matches_tp1(mdir, store_dir) -> float:
    """Every shard equals the tapped states of a one-process target on the same padded batch."""
    with Manifest.open(mdir, readonly=True) as m:
        target = load_target(m.config.target, "cpu", layer_ids=m.meta["layer_ids"])
        store = ShardStore.open(store_dir)
        worst, n = 0.0, 0
        for j in m.jobs():
            shard = store.read_shard(j.epoch, j.id, j.checksum)
            seqs = [torch.from_numpy(m.sample(s)[0].astype("int64")) for s in j.sample_ids]
            ids, attn, lengths = pad_batch(seqs)
            ref = pack_unpadded(target.capture(ids, attn), lengths)
            assert shard.hidden.shape == ref.shape and shard.sample_ids.tolist() == j.sample_ids
            worst = max(worst, (shard.hidden.float() - ref).abs().max().item())
            n += 1
    assert n > 0 and worst <= 1e-5, f"TP=2 vs TP=1: max abs difference {worst}"
    return worst


def test_tp2_worker_and_trainer_side_by_side_exactly_once(tmp_path):
    data = write_dataset(tmp_path / "data.jsonl", n=24)
    cfg = write_config(tmp_path / "cfg.toml", EXTRA)
    work, summary = tmp_path / "w", tmp_path / "summary.json"
    r = run_dflash(
        "pipeline",
        "--config",
        cfg,
        "--data",
        data,
        "--workdir",
        work,
        "--devices",
        "cpu,cpu",
        "--tp",
        "2",
        "--keep-shards",
        "--summary-json",
        summary,
        "--status-every",
        "5",
        timeout=400,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Traceback" not in out and "--tp 2" in out
    s = json.loads(summary.read_text())
    assert s["jobs"]["kept"] == s["total_jobs"] > 0 and s["tokens_trained"] == s["tokens_extracted"] > 0
    mdir = work / "manifest"
    assert_exactly_once(mdir, work / "run")
    with Manifest.open(mdir, readonly=True) as m:
        starts = [json.loads(e["detail"]) for e in m.events("start:extract")]
        assert starts and starts[0]["tp"] == 2  # one worker of two processes
    assert scan_store(work / "store")["temps"] == []
    assert_matches_tp1(mdir, work / "store")


def _spawned(pid: int) -> set[int]:
    """The extract supervisor's worker processes (multiprocessing spawn children)."""
    try:
        return {c.pid for c in psutil.Process(pid).children() if "spawn_main" in " ".join(c.cmdline())}
    except psutil.Error:
        return set()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_kill9_of_a_follower_stops_the_group_and_the_run_completes(tmp_path):
    mdir = plan(tmp_path, n=40, extra=EXTRA + '[target]\nmodel = "tiny:qwen3_moe"\n')
    store = tmp_path / "store"
    p = dflash(
        "extract", "--manifest", mdir, "--store", store, "--devices", "cpu,cpu", "--tp", "2", "--window", "64"
    )
    m = Manifest.open(mdir)
    seen: set[int] = set()
    victim = job = leader = None
    t0 = time.time()
    while victim is None and p.poll() is None and time.time() - t0 < 180:
        seen |= _spawned(p.pid)
        claimed = [j for j in m.jobs("claimed") if j.pid]
        followers = sorted(_spawned(p.pid) - {j.pid for j in claimed})
        if claimed and followers:
            job, leader, victim = claimed[0], claimed[0].pid, followers[0]
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.01)
    assert victim is not None, "the group never claimed a job"
    while p.poll() is None and time.time() - t0 < 300:
        seen |= _spawned(p.pid)
        time.sleep(0.05)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 0, out[-4000:]
    assert f"rank 1 (pid {victim}) was killed (exit code -9)" in out and "restarting it (1 of 3)" in out, out[
        -3000:
    ]
    assert "Traceback" not in out
    # the job went back without counting as an error, before its lease could expire
    back = [e for e in m.events() if e["job"] == job.id and e["kind"] in ("abandon", "reclaim", "error")]
    assert back and back[0]["kind"] in ("abandon", "reclaim"), back
    assert "lease expired" not in back[0]["detail"]
    assert m.counts()["written"] == sum(m.counts().values())
    assert Counter(sorted(ShardStore.open(store).iter_shards())) == Counter((j.epoch, j.id) for j in m.jobs())
    assert scan_store(store)["temps"] == []
    # every process of both groups (the killed one and its restart) is gone
    assert {leader, victim} <= seen and len(seen) >= 4, seen
    assert all(_gone(pid) for pid in seen), [pid for pid in seen if not _gone(pid)]
    assert_matches_tp1(mdir, store)


@pytest.mark.parametrize("rank,error", [(0, "oom"), pytest.param(1, "runtime", marks=pytest.mark.slow)])
def test_a_forward_that_raises_on_one_rank_restarts_the_group_without_waiting(tmp_path, rank, error):
    # extract.lease_s (and so the group's collective timeout) is far beyond this test's timeout: a
    # rank left in a mismatched collective would hang the test rather than end it
    mdir = plan(tmp_path, n=16, extra=EXTRA + "[extract]\nlease_s = 3600\n")
    store, flag = tmp_path / "store", tmp_path / "fail-once"
    flag.write_text("")
    hooks = hooked_env(forward_error={"flag": str(flag), "rank": rank, "error": error})
    args = ["extract", "--manifest", mdir, "--store", store, "--devices", "cpu,cpu", "--tp", "2"]
    r = run([*args, "--window", "64"], environ=hooks, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert not flag.exists()  # the injected failure happened
    assert "failed in a forward (exit code 4)" in out, out[-3000:]  # names the first rank of those
    said = (
        re.compile(
            r"rank 0 of a tensor-parallel group of 2: the forward of job \d+ failed \(out of memory on cpu"
        )
        if rank == 0
        else re.compile(
            r"rank 1 of a tensor-parallel group of 2: the forward failed \(RuntimeError: injected"
        )
    )
    assert said.search(out), out[-3000:]
    assert "restarting it (1 of 3)" in out and "Traceback" not in out, out[-3000:]
    with Manifest.open(mdir, readonly=True) as m:
        assert m.counts()["written"] == sum(m.counts().values())
        back = [
            e for e in m.events() if e["job"] is not None and e["kind"] in ("error", "abandon", "reclaim")
        ]
        assert back, "the job of the failed forward never went back to pending"
        if rank == 0:  # the leader records its own failure (an attempt), naming the setting to lower
            (err,) = [e for e in back if e["kind"] == "error"]
            assert "out of memory on cpu" in err["detail"] and "data.token_budget" in err["detail"]
            assert f"job {err['job']}: out of memory on cpu" in out  # said at once, not only at the end
        else:  # gloo reports the follower's exit to the leader as a RuntimeError: not counted on the job
            assert not [e for e in back if e["kind"] == "error"], back
    assert scan_store(store)["temps"] == []
    assert_matches_tp1(mdir, store)


@pytest.mark.slow  # the default suite's 12 minutes (issue 50); CI runs it (.ci/run)
def test_a_forward_that_always_fails_restarts_the_group_three_times_in_a_row_then_stops(tmp_path):
    mdir = plan(tmp_path, n=16, extra=EXTRA + "[extract]\nlease_s = 3600\nmax_attempts = 1\n")
    flag = tmp_path / "always"
    flag.write_text("")
    hooks = hooked_env(forward_error={"flag": str(flag), "rank": 0, "error": "oom", "keep": True})
    args = ["extract", "--manifest", mdir, "--store", tmp_path / "store", "--devices", "cpu,cpu", "--tp", "2"]
    r = run(args, environ=hooks, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-4000:]
    assert [f"restarting it ({i} of 3)" in out for i in (1, 2, 3)] == [True] * 3, out[-3000:]
    assert out.count("failed in a forward (exit code 4)") == 4 and "not restarting it" in out, out[-3000:]
    with Manifest.open(mdir, readonly=True) as m:  # each start failed one job (max_attempts = 1), no more
        assert m.counts()["failed"] == 4 and m.counts()["written"] == 0


@pytest.mark.slow  # the default suite's 12 minutes (issue 50); CI runs it (.ci/run)
def test_a_failure_while_loading_stops_the_whole_group_before_any_claim(tmp_path):
    mdir = plan(tmp_path, n=8, extra=EXTRA)
    store = tmp_path / "store"
    store.mkdir()
    (store / "unrelated.txt").write_text(
        "not a shard store"
    )  # the leader's store check fails; the follower loads
    r = run_dflash(
        "extract", "--manifest", mdir, "--store", store, "--devices", "cpu,cpu", "--tp", "2", timeout=300
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert out.count("exists and is not empty but holds no shard store") == 1, out
    assert (
        "Traceback" not in out and "exited with an error (exit code 2)" in out and "not restarting it" in out
    )
    with Manifest.open(mdir, readonly=True) as m:
        assert m.counts()["pending"] == sum(m.counts().values())
        assert not [e for e in m.events() if e["job"] is not None]  # nothing was ever claimed
    assert sorted(p.name for p in store.iterdir()) == ["unrelated.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_tp2_hybrid_targets_match_tp1(tmp_path, kind):
    """The hybrid (Gated DeltaNet) tiny targets, as listed in dflash_staged/model/target/parallel.py."""
    mdir = plan(tmp_path, n=12, extra=EXTRA + f'[target]\nmodel = "tiny:{kind}"\n')
    r = run_dflash(
        "extract",
        "--manifest",
        mdir,
        "--store",
        tmp_path / "store",
        "--devices",
        "cpu,cpu",
        "--tp",
        "2",
        "--window",
        "64",
        timeout=400,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert_matches_tp1(mdir, tmp_path / "store")


def test_tp2_extract_stores_the_targets_topk_as_one_process_does(tmp_path):
    """With [target] store_topk, every rank of a TP=2 group runs the head on the packed last layer (the
    head's collectives pair up), and the leader's stored top-k equal a one-process target's (issue 40)."""
    mdir = plan(tmp_path, n=16, extra=EXTRA + "[target]\nstore_topk = 8\n")
    store_dir = tmp_path / "store"
    r = run_dflash(
        "extract", "--manifest", mdir, "--store", store_dir, "--devices", "cpu,cpu", "--tp", "2", timeout=300
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    with Manifest.open(mdir, readonly=True) as m:
        target = load_target(m.config.target, "cpu", layer_ids=m.meta["layer_ids"])
        store = ShardStore.open(store_dir)
        assert store.meta.topk == 8 and store.meta.topk_tail and store.meta.last_layer is None
        n = 0
        for j in m.jobs():
            shard = store.read_shard(j.epoch, j.id, j.checksum)
            seqs = [torch.from_numpy(m.sample(s)[0].astype("int64")) for s in j.sample_ids]
            ids, attn, lengths = pad_batch(seqs)
            last = pack_unpadded(target.capture(ids, attn), lengths)[:, -1]
            want_ids, want_lp, want_tail = target.topk_of(last)
            assert shard.hidden.shape[1] == len(m.meta["layer_ids"])  # the last layer itself is not stored
            assert torch.equal(shard.topk_ids, want_ids)
            torch.testing.assert_close(shard.topk_logprobs.float(), want_lp.float(), atol=1e-2, rtol=1e-3)
            torch.testing.assert_close(shard.topk_logtail, want_tail, atol=1e-3, rtol=1e-3)
            n += 1
    assert n > 0
