"""Mismatch: a store of another manifest or target, a changed config against an existing manifest,
a checkpoint of another manifest or drafter config. Each is refused (exit 1, one clean error line,
no traceback) with a message that says what differs, and nothing is modified.
"""

from __future__ import annotations

import json

import pytest

from dflash_staged.manifest import Manifest
from dflash_staged.store import ShardStore, StoreMeta
from dflash_staged.train.checkpoint import latest_checkpoint

from helpers import cli, run, status, write_config, write_dataset

EXTRA = "[data]\ntoken_budget = 512\n"


def refused(r, *words: str) -> str:
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "Traceback" not in out, out
    errors = [
        x for x in out.splitlines() if x.startswith("error:") or ": error" in x or "extract: worker" in x
    ]
    assert errors, out
    for w in words:
        assert w in out, f"{w!r} not in {out!r}"
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """M1 extracted to S1 and trained (kept shards) into R1; M2 planned from the same data with another
    seed."""
    d = tmp_path_factory.mktemp("mismatch")
    data = write_dataset(d / "data.jsonl", n=12)
    cfg = write_config(d / "cfg.toml", EXTRA)
    for name, seed in (("m1", 0), ("m2", 1)):
        code, out = cli("plan", "--config", cfg, "--data", data, "--manifest", d / name, "--seed", seed)
        assert code == 0, out
    r = run(["extract", "--manifest", d / "m1", "--store", d / "s1", "--devices", "cpu", "--window", 64])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(["train", "--manifest", d / "m1", "--store", d / "s1", "--out", d / "r1", "--keep-shards"])
    assert r.returncode == 0, r.stdout + r.stderr
    return d


def ids(d, name):
    with Manifest.open(d / name, readonly=True) as m:
        return m.manifest_id


def test_store_of_another_manifest_is_refused(world):
    d = world
    before = status(d / "m2")["jobs"]
    want = f"manifest_id='{ids(d, 'm1')}', but this run has manifest_id='{ids(d, 'm2')}'"
    refused(
        run(["extract", "--manifest", d / "m2", "--store", d / "s1", "--devices", "cpu", "--window", 64]),
        str(d / "s1"),
        want,
    )
    refused(
        run(["train", "--manifest", d / "m2", "--store", d / "s1", "--out", d / "r2"]), str(d / "s1"), want
    )
    assert status(d / "m2")["jobs"] == before
    assert status(d / "m1")["jobs"]["kept"] == status(d / "m1")["total_jobs"]  # S1's owner untouched


def test_store_of_another_target_is_refused(world, tmp_path):
    d = world
    store = tmp_path / "store"
    with Manifest.open(d / "m2", readonly=True) as m:
        layers = m.meta["layer_ids"]
    ShardStore.create_or_open(
        store,
        StoreMeta(
            manifest_id=ids(d, "m2"),
            target_id="another-model@abc",
            layer_ids=layers,
            hidden_size=64,
            logical_dtype="float32",
        ),
    )
    out = refused(
        run(["extract", "--manifest", d / "m2", "--store", store, "--devices", "cpu", "--window", 64]),
        "target_id='another-model@abc'",
    )
    assert "but this run has target_id=" in out
    assert status(d / "m2")["jobs"]["claimed"] == 0


@pytest.mark.parametrize(
    "change, words",
    [
        ("[data]\ntoken_budget = 1024\n", ["config.data.token_budget: 512 -> 1024"]),
        ("[drafter]\nblock_size = 4\n", ["config.drafter.block_size: 8 -> 4"]),
        ("[target]\ntarget_layer_ids = [0, 2]\n", ["config.target.target_layer_ids: [] -> [0, 2]"]),
        (
            "[train]\nlr = 0.001\n[extract]\nwindow = 32\n",
            ["config.train.lr: 0.002 -> 0.001", "config.extract.window: 16 -> 32"],
        ),
    ],
)
def test_changed_config_against_existing_manifest_is_refused(world, tmp_path, change, words):
    d = world
    cfg = write_config(tmp_path / "cfg.toml", change, base=write_config(tmp_path / "base.toml", EXTRA))
    code, out = cli("plan", "--config", cfg, "--data", d / "data.jsonl", "--manifest", d / "m1")
    assert code == 1 and "Traceback" not in out, out
    assert out.startswith("error: ") and str(d / "m1") in out and "planned from different inputs" in out, out
    for w in words:
        assert w in out, out
    assert status(d / "m1")["jobs"]["kept"] == status(d / "m1")["total_jobs"]  # untouched


def test_changed_shard_settings_at_train_time_are_refused(world, tmp_path):
    d = world
    r = run(
        [
            "train",
            "--manifest",
            d / "m1",
            "--store",
            d / "s1",
            "--out",
            tmp_path / "r",
            "--set",
            "drafter.block_size=4",
        ]
    )
    refused(r, "drafter.block_size cannot be changed for train")
    r = run(
        [
            "train",
            "--replay",
            "--manifest",
            d / "m1",
            "--store",
            d / "s1",
            "--out",
            tmp_path / "r",
            "--set",
            "target.target_layer_ids=[0]",
        ]
    )
    refused(r, "target.target_layer_ids cannot be changed")


def test_checkpoint_of_another_manifest_is_refused(world, tmp_path):
    d = world
    store = tmp_path / "s2"  # a valid (empty) store for m2, so the trainer gets as far as resuming
    with Manifest.open(d / "m1", readonly=True) as m:
        layers = m.meta["layer_ids"]
    s1 = ShardStore.open(d / "s1")
    ShardStore.create_or_open(
        store,
        StoreMeta(
            manifest_id=ids(d, "m2"),
            target_id=s1.meta.target_id,
            layer_ids=layers,
            hidden_size=s1.meta.hidden_size,
            logical_dtype=s1.meta.logical_dtype,
        ),
    )
    ck = latest_checkpoint(d / "r1")
    r = run(["train", "--manifest", d / "m2", "--store", store, "--out", d / "r1"])
    refused(r, str(ck), f"belongs to manifest {ids(d, 'm1')}", str(d / "m2"))
    assert latest_checkpoint(d / "r1") == ck
    assert status(d / "m2")["jobs"]["consumed"] == 0


def test_checkpoint_of_another_drafter_config_is_refused(world):
    d = world
    ck = latest_checkpoint(d / "r1")
    metrics = (d / "r1" / "metrics.jsonl").read_text()
    r = run(
        [
            "train",
            "--replay",
            "--manifest",
            d / "m1",
            "--store",
            d / "s1",
            "--out",
            d / "r1",
            "--set",
            "drafter.block_size=4",
            "--set",
            "drafter.intermediate_size=128",
        ]
    )
    out = refused(r, str(ck), "another drafter config", "block_size: 8 -> 4", "intermediate_size: 256 -> 128")
    assert json.loads((ck / "config.json").read_text())["block_size"] == 8
    assert (d / "r1" / "metrics.jsonl").read_text() == metrics and latest_checkpoint(d / "r1") == ck
    assert out.count("error:") == 1
