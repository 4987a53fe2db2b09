"""FP8 hidden states end to end (issue 43): a tiny plan -> extract | train --keep-shards on a bfloat16
target with [extract] store_dtype = "float8_e4m3fn" trains every job exactly once on shards at most
0.55x the bytes a token of the same run at full precision; two replays of the kept FP8 shards are equal;
and a checkpoint trained on another precision is refused, naming both."""

from __future__ import annotations

import json

import pytest

from dflash_staged.manifest import Manifest
from dflash_staged.store import ShardStore, bytes_per_token

from helpers import plan, run_dflash
from rel_helpers import assert_exactly_once, side_by_side

COMMON = '[data]\ntoken_budget = 512\n[target]\ndtype = "bfloat16"\n[train]\ncheckpoint_every = 3\n'
FP8 = '[extract]\nstore_dtype = "float8_e4m3fn"\n'


def metrics(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def run(tmp_path, extra: str) -> tuple:
    tmp_path.mkdir()
    mdir = plan(tmp_path, n=40, extra=COMMON + extra)
    store, out = tmp_path / "store", tmp_path / "run"
    logs = side_by_side(tmp_path, mdir, store, out, ["--keep-shards"])
    assert_exactly_once(mdir, out)
    with Manifest.open(mdir, readonly=True) as m:
        jobs = m.jobs()
        assert all(j.state == "kept" for j in jobs)
        bpt = int(m.meta["bytes_per_token"])
        tokens, nbytes = sum(j.real_tokens for j in jobs), sum(j.shard_bytes or 0 for j in jobs)
    return mdir, store, out, bpt, nbytes / tokens, logs


@pytest.mark.slow  # 30-70 s: the default suite's 12 minutes; CI runs it (.ci/run)
def test_fp8_store_trains_exactly_once_at_half_the_bytes_and_replays_equal(tmp_path):
    mdir, store, out, bpt, per_token, logs = run(tmp_path / "fp8", FP8)
    assert ShardStore.open(store).meta.store_dtype == "float8_e4m3fn"
    assert "FP8 states stay one byte a value" in logs  # the buffer's RAM line says so
    meta = ShardStore.open(store).meta  # the same run at full precision: the sizes test_fp8 checks on disk
    bpt16 = bytes_per_token(meta.stored_layers, meta.hidden_size, 2, meta.topk, "target")
    print(f"bytes a token: FP8 {bpt} ({per_token:.1f} on disk) against bfloat16 {bpt16}")
    assert bpt <= 0.55 * bpt16 and per_token <= 0.55 * bpt16
    # the kept FP8 shards replay deterministically
    args = ("train", "--replay", "--manifest", mdir, "--store", store)
    a, b = run_dflash(*args, "--out", tmp_path / "a"), run_dflash(*args, "--out", tmp_path / "b")
    assert a.returncode == 0 and b.returncode == 0, a.stdout + a.stderr
    la, lb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert len(la) >= 3 and [x["loss"] for x in la] == [x["loss"] for x in lb]
    # a checkpoint trained on another precision is refused, naming both
    states = sorted((tmp_path / "a" / "checkpoints").glob("*/trainer_state.json"))
    state = json.loads(states[-1].read_text())
    assert state["store_dtype"] == "float8_e4m3fn"
    states[-1].write_text(json.dumps({**state, "store_dtype": "target"}))
    r = run_dflash(*args, "--out", tmp_path / "a")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "store_dtype = 'target'" in r.stderr and "'float8_e4m3fn'" in r.stderr, r.stderr[-2000:]
