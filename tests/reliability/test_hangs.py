"""Settings that used to hang forever either finish or are refused up front (issue 22, items 2-3).

Before the window rule counted the trainer's whole buffer, a window smaller than it, with every
shard of one length bucket, left extract waiting for room and the trainer for a second bucket.
"""

from __future__ import annotations

import json
import time

import pytest

from dflash_staged.config import load_config
from dflash_staged.manifest import Manifest
from dflash_staged.manifest.window import window_check

from helpers import TINY, plan, run, start
from rel_helpers import assert_all_released_and_clean, assert_exactly_once

ONE_BUCKET = "[data]\nnum_buckets = 1\ntoken_budget = 512\n"


def test_window_rule_in_shards_and_bytes():
    cfg = load_config(TINY)  # buffer_capacity 4, min_ready 2, grad_accum 2, checkpoint_every 2
    err, _ = window_check(cfg, 3, workers=1, ranks=1)
    assert err and "--window 3" in err and "at least 4" in err  # the old rule (min_ready x 1 = 2) passed it
    assert window_check(cfg, 4, workers=1, ranks=1)[0] is None
    err, _ = window_check(cfg, 7, workers=1, ranks=2)  # two ranks need two buffers
    assert err and "at least 8" in err
    err, _ = window_check(cfg, 64, workers=1, ranks=2, window_bytes=8 * 1000 - 1, shard_bytes_max=1000)
    assert err and err.startswith("--window-bytes") and "buffer_capacity 4 x 2" in err
    assert window_check(cfg, 64, workers=1, ranks=2, window_bytes=8 * 1000, shard_bytes_max=1000)[0] is None
    err, warn = window_check(cfg, 8, workers=2, ranks=1)
    assert err is None and "6 shard(s) short" in warn  # 4 + 3 x 2 + 2 x 2 x 1 = 14


def _refused(r, flag: str):
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and flag in r.stderr, r.stderr
    return r.stderr


def test_one_bucket_small_window_is_refused(tmp_path):
    mdir = plan(tmp_path, n=40, extra=ONE_BUCKET)
    with Manifest.open(mdir, readonly=True) as m:
        assert {j.bucket for j in m.jobs()} == {0}
    r = run(["extract", "--manifest", mdir, "--store", tmp_path / "store", "--devices", "cpu", "--window", 3])
    _refused(r, "--window 3")
    r = run(
        [
            "extract",
            "--manifest",
            mdir,
            "--store",
            tmp_path / "store",
            "--devices",
            "cpu",
            "--window",
            7,
            "--train-ranks",
            2,
        ]
    )
    _refused(r, "at least 8")
    with Manifest.open(mdir, readonly=True) as m:
        assert m.counts()["pending"] == sum(m.counts().values())  # refused before any claim


def test_window_bytes_below_the_buffers_is_refused(tmp_path):
    mdir = plan(tmp_path, n=40, extra=ONE_BUCKET)
    r = run(
        [
            "extract",
            "--manifest",
            mdir,
            "--store",
            tmp_path / "store",
            "--devices",
            "cpu",
            "--window",
            64,
            "--window-bytes",
            "64K",
        ]
    )
    line = _refused(r, "--window-bytes")
    assert "raise --window-bytes to at least" in line.lower()
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_one_bucket_at_the_smallest_window_finishes(tmp_path, nproc):
    """Every shard of one length bucket, the window exactly the trainers' buffers: it finishes."""
    mdir = plan(tmp_path, n=48, extra=ONE_BUCKET)
    store, out = tmp_path / "store", tmp_path / "run"
    window = 4 * nproc
    ex = start(
        [
            "extract",
            "--manifest",
            mdir,
            "--store",
            store,
            "--devices",
            "cpu",
            "--window",
            window,
            "--train-ranks",
            nproc,
        ],
        tmp_path / "extract.log",
    )
    ranks = ["--nproc", nproc, "--device", "cpu"] if nproc > 1 else []
    tr = start(["train", "--manifest", mdir, "--store", store, "--out", out, *ranks], tmp_path / "train.log")
    deadline = time.time() + 300
    while (ex.poll() is None or tr.poll() is None) and time.time() < deadline:
        time.sleep(0.2)
    logs = (tmp_path / "extract.log").read_text() + (tmp_path / "train.log").read_text()
    for p in (ex, tr):
        if p.poll() is None:
            p.kill()
    assert tr.returncode == 0 and ex.returncode == 0, logs[-3000:]
    state = assert_exactly_once(mdir, out)
    assert state["world"] == nproc
    assert_all_released_and_clean(mdir, store, out)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(x["buffer"] for x in lines) <= 4
