"""Disk full: store writes fail with ENOSPC (fault injection at the store's one write call).

`dflash extract` must stop with exit code 3 and a message naming the store path and the bytes
needed; every job it held goes back to `pending` (nothing stays `claimed` or becomes `failed`),
no partial shard or temporary file is left, the shards already written stay intact; once space
is freed, rerunning completes with one verified shard per job.
"""

from __future__ import annotations

import errno
import os
import re

import pytest
import torch

import dflash_staged.store.shardfiles as shardfiles
from dflash_staged.manifest import Manifest
from dflash_staged.store import ShardStore, StoreFullError, StoreMeta

from helpers import plan, run, status
from pgcluster import PG_SLOW
from rel_helpers import assert_all_released_and_clean, assert_exactly_once, hooked_env, scan_store

EXTRA = "[data]\ntoken_budget = 512\n"


def extract(mdir, store, environ=None, devices="cpu,cpu"):
    return run(
        ["extract", "--manifest", mdir, "--store", store, "--devices", devices, "--window", 64], environ
    )


def assert_consistent_after_full(mdir, store, r):
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    msgs = re.findall(
        r"no space left on the disk of shard store (\S+) while (?:writing shard e\d+/j\d+ \((\d+) bytes "
        r"needed\)|creating it)",
        r.stderr,
    )
    assert msgs, r.stderr
    assert all(path == str(store) for path, _ in msgs), msgs
    st = status(mdir)
    assert st["jobs"]["claimed"] == 0 and st["jobs"]["failed"] == 0, st["jobs"]
    assert st["jobs"]["pending"] > 0 and not st["extract_done"]
    scan = scan_store(store)
    assert scan["temps"] == [], scan["temps"]
    with Manifest.open(mdir, readonly=True) as m:
        written = {(j.epoch, j.id): j for j in m.jobs("written")}
        assert sorted(scan["published"]) == sorted(written), (
            "a shard on disk is not marked written (or vice versa)"
        )
        if written:
            s = ShardStore.open(store)
            for j in written.values():
                s.read_shard(j.epoch, j.id, j.checksum)  # intact and verified
        abandons = [e for e in m.events("abandon") if "disk full" in (e["detail"] or "")]
    return msgs, abandons


def complete_after_freeing(mdir, store, flag, environ):
    flag.unlink()  # space freed
    r = extract(mdir, store, environ)
    assert r.returncode == 0, r.stdout + r.stderr
    with Manifest.open(mdir, readonly=True) as m:
        jobs = m.jobs()
        assert all(j.state == "written" for j in jobs)
        s = ShardStore.open(store)
        assert sorted(scan_store(store)["published"]) == sorted((j.epoch, j.id) for j in jobs)
        for j in jobs:
            assert s.read_shard(j.epoch, j.id, j.checksum).hidden.shape[0] == j.real_tokens
    assert scan_store(store)["temps"] == []


@pytest.mark.slow  # the default suite's 12 minutes (issue 50); CI runs it (.ci/run)
@pytest.mark.parametrize("backend", PG_SLOW, indirect=True)
def test_disk_full_then_freed(tmp_path, backend):
    mdir = plan(tmp_path, epochs=2, extra=EXTRA, manifest=backend.address(tmp_path))
    store, flag = tmp_path / "store", tmp_path / "disk-full"
    environ = hooked_env(enospc_flag=str(flag))
    # 1. the disk is full from the start: not even the store can be created
    flag.write_text("0")
    msgs, _ = assert_consistent_after_full(mdir, store, extract(mdir, store, environ, devices="cpu"))
    assert all(need == "" for _, need in msgs), msgs  # "while creating it"
    assert not store.exists() and not list(tmp_path.glob(".store.tmp~*")), "a half-created store was left"
    # 2. the disk fills up mid-run: each worker may write ~400 KB (one or two shards, the last one cut short)
    flag.write_text("400000")
    msgs, abandons = assert_consistent_after_full(mdir, store, extract(mdir, store, environ))
    assert any(need for _, need in msgs) and all(int(need) > 0 for _, need in msgs if need), msgs
    assert abandons, "the job being written was not given back"
    assert status(mdir)["jobs"]["written"] >= 1
    # 3. space freed: a rerun completes
    complete_after_freeing(mdir, store, flag, environ)


def _meta():
    return StoreMeta(manifest_id="m", target_id="t", layer_ids=[1, 2], hidden_size=4, logical_dtype="float32")


def _full_disk(monkeypatch):
    def write(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shardfiles, "_os_write", write)


def test_full_disk_when_creating_store_or_epoch_is_store_full_error(tmp_path, monkeypatch):
    """Regression: ENOSPC while creating the store or a new epoch directory escaped as a raw OSError
    (a traceback, and the job counted as a write error towards `failed`)."""
    store = ShardStore.create_or_open(tmp_path / "store", _meta())
    _full_disk(monkeypatch)
    with pytest.raises(
        StoreFullError, match=r"shard store .*store while writing shard e7/j3 \(\d+ bytes needed\)"
    ):
        store.stage_shard(
            7,
            3,
            torch.zeros(5, 2, 4),
            torch.arange(5) + 4,
            torch.ones(5),
            torch.tensor([0, 5]),
            torch.tensor([0]),
        )
    assert scan_store(tmp_path / "store")["temps"] == []
    with pytest.raises(StoreFullError, match="while creating it"):
        ShardStore.create_or_open(tmp_path / "store2", _meta())
    assert not (tmp_path / "store2").exists() and not list(tmp_path.glob(".store2.tmp~*"))


@pytest.mark.slow  # 30-70 s: the default suite's 12 minutes; CI runs it (.ci/run)
def test_checkpoint_on_a_full_disk_is_one_line_and_a_rerun_resumes(tmp_path):
    """Regression: a full disk while `dflash train` wrote a checkpoint was a raw traceback (safetensors'
    SafetensorError). Now: one line naming the checkpoint directory and the bytes needed, exit 1, no
    temporaries; once space is freed the same command resumes and trains every job exactly once."""
    mdir = plan(tmp_path, n=12, extra=EXTRA)
    store, run_dir, flag = tmp_path / "store", tmp_path / "run", tmp_path / "disk-full"
    r = extract(mdir, store, devices="cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    flag.write_text("")
    environ = hooked_env(checkpoint_enospc_flag=str(flag))
    args = ["train", "--manifest", mdir, "--store", store, "--out", run_dir, "--device", "cpu"]
    r = run(args, environ)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, r.stderr
    want = (
        rf"no space left on the disk of checkpoint directory {re.escape(str(run_dir / 'checkpoints'))} "
        r"while writing checkpoint step_\d{8} \((\d+) bytes needed, \d+ free\)"
    )
    found = re.search(want, errors[0])
    assert found and int(found.group(1)) > 0, errors[0]
    assert list((run_dir / "checkpoints").iterdir()) == [], "a half-written checkpoint was left"
    st = status(mdir)
    assert st["jobs"]["claimed"] == 0 and st["jobs"]["failed"] == 0 and st["processes"] == [], st
    flag.unlink()  # space freed
    r = run(args, environ)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_exactly_once(mdir, run_dir)
    assert_all_released_and_clean(mdir, store, run_dir)


def test_full_disk_anywhere_in_a_checkpoint_is_checkpoint_disk_full_error(tmp_path):
    """An OSError ENOSPC (config.json, the weights) is the same one-line error; other errors are not."""
    from dflash_staged.train.checkpoint import CheckpointDiskFullError, TrainerState, save_checkpoint

    def full(d):
        (d / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def broken(d):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    state = TrainerState({}, {"master.w": torch.zeros(300)})
    with pytest.raises(CheckpointDiskFullError, match=r"step_00000007 \(1600 bytes needed"):
        save_checkpoint(tmp_path, 7, write_drafter=full, state=state, keep=2)
    with pytest.raises(OSError, match="Input/output error"):
        save_checkpoint(tmp_path, 7, write_drafter=broken, state=state, keep=2)
    assert list((tmp_path / "checkpoints").iterdir()) == []
