"""Side by side with the target's top-k log-probabilities in the store and a `tv` term (issue 40): every
job is trained exactly once, the shards are smaller than the same plan's with the last layer stored,
and metrics.jsonl carries the target metrics, all without the target's head in the trainer."""

from __future__ import annotations

import json

import pytest

from dflash_staged.manifest import Manifest

from helpers import plan
from rel_helpers import assert_all_released_and_clean, assert_exactly_once, side_by_side

COMMON = (
    "[data]\ntoken_budget = 512\n"
    "[train]\nloss = { ce = 0.1, tv = 0.9 }\nlog_every = 1\ncheckpoint_every = 3\n"
)


def run(tmp_path, target: str) -> tuple[object, int]:
    tmp_path.mkdir()
    mdir = plan(tmp_path, n=48, extra=COMMON + target)
    store, out = tmp_path / "store", tmp_path / "run"
    side_by_side(tmp_path, mdir, store, out)
    assert_exactly_once(mdir, out)
    assert_all_released_and_clean(mdir, store, out)
    with Manifest.open(mdir, readonly=True) as m:
        nbytes = sum(j.shard_bytes or 0 for j in m.jobs())
    return out, nbytes


@pytest.mark.slow  # 30-70 s: the default suite's 12 minutes; CI runs it (.ci/run)
def test_topk_side_by_side_trains_exactly_once_on_a_smaller_store(tmp_path):
    out, topk_bytes = run(tmp_path / "topk", "[target]\nstore_topk = 16\n")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("target_acc" in x and "expected_tau" in x and x["loss"] is not None for x in lines)
    _, last_bytes = run(tmp_path / "last", "[target]\nstore_last_layer = true\n")
    print(f"store bytes: top-16 {topk_bytes:,} against the last layer's {last_bytes:,}")
    assert 0 < topk_bytes < last_bytes
