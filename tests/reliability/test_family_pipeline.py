"""Each drafter family beyond DFlash trains side by side with extract on the tiny target with its last
layer stored: every job exactly once, a checkpoint whose config.json names the family as the runtimes
read it, and ``dflash eval`` decoding it. A DSpark run over a store without the last layer is refused
before its first step, in one line."""

from __future__ import annotations

import json

import pytest

from dflash_staged.train.checkpoint import latest_checkpoint

from helpers import cli, plan, write_config, write_dataset
from rel_helpers import assert_all_released_and_clean, assert_exactly_once, side_by_side

FAMILIES = {
    "dspark": (
        'architecture = "dspark"\nblock_size = 7\n[drafter.options]\nmarkov_rank = 16\n',
        "Qwen3DSparkModel",
    ),
    "dspine": (
        'architecture = "dspine"\n[drafter.options]\ntransfer_rank = 32\nmessage_size = 16\ntop_k = 4\n',
        "DSpineDraftModel",
    ),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_trains_exactly_once_side_by_side_and_evaluates(tmp_path, name):
    drafter, arch = FAMILIES[name]
    extra = (
        "[data]\ntoken_budget = 512\n[target]\nstore_last_layer = true\n[train]\ncheckpoint_every = 3\n"
        f"[drafter]\n{drafter}"
    )
    mdir = plan(tmp_path, n=48, extra=extra)
    store, out = tmp_path / "store", tmp_path / "run"
    side_by_side(tmp_path, mdir, store, out)
    state = assert_exactly_once(mdir, out)
    assert state["config"]["drafter"]["architecture"] == name
    ck = latest_checkpoint(out)
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["architectures"] == [arch]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(f"{name}_ce" in x and "expected_tau" in x for x in lines if x["loss"] is not None)
    assert_all_released_and_clean(mdir, store, out)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": list(range(10, 30))}) + "\n")
    code, text = cli(
        "eval", "--drafter", out, "--target", tmp_path / "cfg.toml", "--prompts", prompts,
        "--max-new-tokens", 16, "--device", "cpu", "--json", "--temperature", "0,1",
    )  # fmt: skip
    assert code == 0, text
    report = json.loads(text.strip().splitlines()[-1])
    assert report["architecture"] == name and report["lossless"]["identical_prompts"] == 1
    assert 1.0 <= report["tau"] <= report["drafts_per_step"] + 1 and report["runs"][1]["tau"] >= 1.0


def test_dspark_without_a_stored_distribution_is_refused_by_plan(tmp_path):
    """Refused before the target is loaded or anything written (issue 50); the trainer's own check, for a
    store planned by an older version, is tests/test_dspark.py's."""
    data = write_dataset(tmp_path / "data.jsonl", n=16)
    cfg = write_config(tmp_path / "cfg.toml", "[drafter]\n" + FAMILIES["dspark"][0])
    code, text = cli("plan", "--config", cfg, "--data", data, "--manifest", tmp_path / "m")
    assert code == 1 and "'dspark' learns from the target's own distribution" in text, text
    assert "store_last_layer = true" in text and "Traceback" not in text and len(text.splitlines()) == 1
    assert not (tmp_path / "m").exists()
