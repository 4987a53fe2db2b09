"""The store never holds more than ``--window-bytes`` plus the shard each worker is writing (issue 33,
item 3), even while the trainer's background remover is slow to delete released shards' files.

Before the fix the ledger committed a release (freeing extract's window) while the remover was still
deleting that batch's files, so extract refilled the room and the store held up to a batch more than
the window: a window sized to the disk could hit ENOSPC.
"""

from __future__ import annotations

import time

from dflash_staged.manifest import Manifest
from dflash_staged.model.target.dims import target_dims

from helpers import plan, start
from rel_helpers import (
    assert_all_released_and_clean,
    assert_exactly_once,
    chunk_bytes,
    hooked_env,
    tracebacks,
)

EXTRA = "[data]\ntoken_budget = 512\n"


def test_store_stays_within_window_bytes_while_the_remover_is_slow(tmp_path):
    mdir = plan(tmp_path, n=120, extra=EXTRA)
    with Manifest.open(mdir, readonly=True) as m:
        layers, hidden, _ = target_dims(m.config.target)
        per_token = (len(m.meta["layer_ids"]) or layers) * hidden * 4 + 5
        largest = (
            max(j.real_tokens for j in m.jobs()) * per_token
            + max(len(j.sample_ids) for j in m.jobs()) * 16
            + 8
        )
        njobs = len(m.jobs())
    window_bytes = 6 * largest  # the rule needs buffer_capacity 4 x 1 rank x the largest shard
    store, out = tmp_path / "store", tmp_path / "run"
    env = hooked_env(slow_remove_s=0.8)
    ex = start(
        ["extract", "--manifest", mdir, "--store", store, "--devices", "cpu"]
        + ["--window", 64, "--window-bytes", window_bytes],
        tmp_path / "extract.log",
        env,
    )
    tr = start(["train", "--manifest", mdir, "--store", store, "--out", out], tmp_path / "train.log", env)
    peak, samples, deadline = 0, 0, time.time() + 400
    try:
        while (ex.poll() is None or tr.poll() is None) and time.time() < deadline:
            if store.is_dir():
                peak = max(peak, chunk_bytes(store))
                samples += 1
            time.sleep(0.01)
    finally:
        for p in (ex, tr):
            if p.poll() is None:
                p.kill()
    logs = (tmp_path / "extract.log").read_text() + (tmp_path / "train.log").read_text()
    assert ex.returncode == 0 and tr.returncode == 0, logs[-4000:]
    assert not tracebacks(logs), tracebacks(logs)[:2]
    bound = window_bytes + largest  # one worker: plus the one shard it may be writing
    print(
        f"{njobs} jobs, {samples} samples: store peak {peak:,} bytes of shard data against --window-bytes "
        f"{window_bytes:,} + one shard being written ({largest:,}) = {bound:,} ({peak / window_bytes:.2f}x "
        "the window)"
    )
    assert peak <= bound, f"the store held {peak:,} bytes > {bound:,} (window {window_bytes:,} + one shard)"
    assert_exactly_once(mdir, out)
    assert_all_released_and_clean(mdir, store, out)
