"""The target's last layer in the store (issue 31, items 1-2): captured bit for bit beside the taps,
the target's logits recomputed from it equal to the target's own, the store's and the window's
accounting, the plan's record, and a trainer refused before any step when it needs the last layer
and the store lacks it."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_staged.config import TargetConfig
from dflash_staged.manifest import Manifest
from dflash_staged.model.target import load_target, pad_batch
from dflash_staged.model.target.weights import load_embed_and_head, load_final_norm
from dflash_staged.store import ShardStore

from helpers import plan, run, run_dflash

EXTRA = "[data]\ntoken_budget = 512\n"
LAST = "[target]\nstore_last_layer = true\n"


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, 500, (n,), generator=g) for n in (17, 9, 30)]
    ids, attn, _ = pad_batch(seqs, pad_id=0)
    return ids, attn


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_the_stored_last_layer_is_the_targets_own_bit_for_bit_and_gives_its_logits(kind):
    cfg = TargetConfig(model=f"tiny:{kind}", store_last_layer=True, allow_slow_kernels=True)
    t = load_target(cfg, "cpu", layer_ids=[1, 3])
    assert t.stored_ids == [1, 3, t.num_layers - 1] and t.last_layer == t.num_layers - 1
    ids, attn = batch()
    got = t.capture(ids, attn)
    assert got.shape[2] == 3 and got.dtype == torch.float32
    seen = {}
    hook = t.layers[-1].register_forward_hook(
        lambda m, a, out: seen.update(h=(out[0] if isinstance(out, tuple) else out).clone())
    )
    try:
        with torch.inference_mode():
            logits = t.model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    finally:
        hook.remove()
    assert torch.equal(got[:, :, 2], seen["h"])  # the last decoder layer's output, before the final norm
    plain = load_target(TargetConfig(model=f"tiny:{kind}", allow_slow_kernels=True), "cpu", layer_ids=[1, 3])
    assert torch.equal(plain.capture(ids, attn), got[:, :, :2])  # the taps are unchanged
    norm = load_final_norm(cfg)
    _, head = load_embed_and_head(cfg)
    recomputed = norm(got[:, :, 2]) @ head.t().float()
    real = attn.bool()
    torch.testing.assert_close(recomputed[real], logits[real], rtol=1e-5, atol=1e-5)


def test_extract_stores_the_last_layer_and_counts_it(tmp_path):
    mdir = plan(tmp_path, n=16, extra=EXTRA + LAST)
    r = run(["extract", "--manifest", mdir, "--store", tmp_path / "store", "--devices", "cpu"])
    assert r.returncode == 0, r.stderr
    with Manifest.open(mdir, readonly=True) as m:
        assert m.config.target.store_last_layer
        store = ShardStore.open(tmp_path / "store", expect={"manifest_id": m.manifest_id})
        taps = list(m.meta["layer_ids"])
        assert store.meta.last_layer == 5 and store.meta.stored_layers == len(taps) + 1
        H = store.meta.hidden_size
        assert m.meta["bytes_per_token"] == (len(taps) + 1) * H * 4 + 5  # the window's byte estimate
        j = m.jobs("written")[0]
        shard = store.read_shard(j.epoch, j.id, j.checksum)
        assert tuple(shard.hidden.shape) == (j.real_tokens, len(taps) + 1, H)
        assert j.shard_bytes == sum(
            x.numel() * x.element_size() for x in (shard.hidden, shard.input_ids, shard.loss_mask)
        ) + 8 * (shard.cu_seqlens.numel() + shard.sample_ids.numel())
    # the node's disk arithmetic counts it
    from dflash_staged.launch.disk import disk_requirements

    d, lines = disk_requirements(tmp_path / "cfg.toml", 1, 1000.0, 128, mdir, None, itemsize=2)
    assert d["k"] == len(taps) + 1 and f"({len(taps)} tapped + the last)" in lines[0]


def test_a_loss_on_the_target_without_the_last_layer_is_refused_before_any_step(tmp_path):
    mdir = plan(tmp_path, n=16, extra=EXTRA)
    r = run(["extract", "--manifest", mdir, "--store", tmp_path / "store", "--devices", "cpu"])
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run"
    r = run_dflash(
        "train",
        "--manifest",
        mdir,
        "--store",
        tmp_path / "store",
        "--out",
        out,
        "--set",
        "train.loss={kl=1.0}",
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "store_last_layer = true" in r.stderr and "train.loss" in r.stderr, r.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_a_store_with_the_last_layer_trains_either_objective_and_logs_the_target_metrics(tmp_path):
    mdir = plan(tmp_path, n=24, extra=EXTRA + LAST)
    r = run(["extract", "--manifest", mdir, "--store", tmp_path / "store", "--devices", "cpu"])
    assert r.returncode == 0, r.stderr
    runs = {
        "ce": ["--keep-shards"],  # the live run keeps the shards for the replay
        "mix": ["--replay", "--set", "train.loss={ce=0.1, tv=0.9}"],
    }
    for name, args in runs.items():
        out = tmp_path / name
        r = run_dflash(
            "train", "--manifest", mdir, "--store", tmp_path / "store", "--out", out,
            "--set", "train.log_every=1", *args,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert lines and all(0 < x["expected_tau"] and len(x["overlap"]) == len(x["acc"]) for x in lines)
        assert all(0 <= a <= 1 for x in lines for a in x["overlap"] + x["target_acc"])
