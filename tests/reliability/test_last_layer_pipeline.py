"""Side by side with the target's last layer stored and a mixed objective (issue 31): extract and train
run together with a byte window, the trainer is killed with SIGKILL between two checkpoints and
restarted; every job is trained exactly once, the store's sampled bytes stay within the window (plus
the shard being written), and the resumed run goes on with the mixed objective and its metrics."""

from __future__ import annotations

import json
import signal
import time

from dflash_staged.manifest import Manifest
from dflash_staged.model.target.dims import target_dims
from dflash_staged.train.checkpoint import latest_checkpoint

from helpers import plan, start
from rel_helpers import assert_all_released_and_clean, assert_exactly_once, chunk_bytes, tracebacks

EXTRA = (
    "[data]\ntoken_budget = 512\n[target]\nstore_last_layer = true\n"
    "[train]\nloss = { ce = 0.1, tv = 0.9 }\nlog_every = 1\ncheckpoint_every = 3\n"
)


def test_last_layer_side_by_side_with_a_kill_and_a_resume(tmp_path):
    mdir = plan(tmp_path, n=96, extra=EXTRA)
    with Manifest.open(mdir, readonly=True) as m:
        _, hidden, _ = target_dims(m.config.target)
        per_token = (len(m.meta["layer_ids"]) + 1) * hidden * 4 + 5  # the taps and the last layer
        largest = (
            max(j.real_tokens for j in m.jobs()) * per_token
            + max(len(j.sample_ids) for j in m.jobs()) * 16
            + 8
        )
    window_bytes = 8 * largest
    store, out = tmp_path / "store", tmp_path / "run"
    ex = start(
        ["extract", "--manifest", mdir, "--store", store, "--devices", "cpu"]
        + ["--window", 32, "--window-bytes", window_bytes],
        tmp_path / "extract.log",
    )
    train = ["train", "--manifest", mdir, "--store", store, "--out", out]
    tr = start(train, tmp_path / "train.log")
    peak, killed, deadline = 0, False, time.time() + 400
    try:
        while (ex.poll() is None or tr.poll() is None) and time.time() < deadline:
            if store.is_dir():
                peak = max(peak, chunk_bytes(store))
            if not killed:
                ck = latest_checkpoint(out)
                done = (
                    len((out / "metrics.jsonl").read_text().splitlines())
                    if (out / "metrics.jsonl").exists()
                    else 0
                )
                if ck is not None and done > int(ck.name[5:]):  # past a checkpoint, mid-interval
                    tr.send_signal(signal.SIGKILL)
                    tr.wait()
                    killed_at = done
                    killed = True
                    tr = start(train, tmp_path / "train.log")
            time.sleep(0.01)
    finally:
        for p in (ex, tr):
            if p.poll() is None:
                p.kill()
    logs = (tmp_path / "extract.log").read_text() + (tmp_path / "train.log").read_text()
    assert killed, logs[-3000:]
    assert ex.returncode == 0 and tr.returncode == 0, logs[-4000:]
    assert not tracebacks(logs), tracebacks(logs)[:2]
    bound = window_bytes + largest
    print(f"store peak {peak:,} bytes against --window-bytes {window_bytes:,} + one shard = {bound:,}")
    assert peak <= bound
    state = assert_exactly_once(mdir, out)
    assert state["config"]["train"]["loss"] == {"ce": 0.1, "tv": 0.9}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) > killed_at  # the resumed run went on past the kill, with the mixed objective
    assert all("expected_tau" in x and x["loss"] is not None for x in lines)
    assert_all_released_and_clean(mdir, store, out)
