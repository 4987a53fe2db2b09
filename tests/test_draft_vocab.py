"""A draft vocabulary (dflash_staged/model/drafters/vocab.py): chosen at plan, carried by the checkpoint in
the engines' format, trained over (labels outside masked, the target renormalised), decoded over."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters import vocab
from dflash_staged.model.drafters.target_dist import TopK, topk_logp
from dflash_staged.train.objective import dflash_loss, sample_anchors
from dflash_staged.train.objective.anchors import block_labels

from helpers import V, cli, make_drafter, packed_batch, plan, write_config, write_dataset

N = 40


def vocab_ids(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(V - 1, generator=g)[:n].sort().values


def test_choose_takes_the_most_frequent_ties_to_the_lower_id_and_says_what_it_covers():
    counts = np.array([0, 5, 3, 3, 9, 0, 3, 1])
    v = vocab.choose(counts, 3)
    assert v.ids.tolist() == [1, 2, 4]  # 9, 5, then the lowest of the three 3s
    assert (v.loss_tokens, v.covered, v.seen) == (24, 17, 6)
    assert v.coverage == pytest.approx(17 / 24)
    assert vocab.coverage(counts, [1, 3, 8]) == pytest.approx({1: 9 / 24, 3: 17 / 24, 8: 1.0})
    assert vocab.counts_of(json.loads(json.dumps(vocab.counts_record(counts)))).tolist() == counts.tolist()
    with pytest.raises(DflashError, match="draft_vocab_size=8: use 1..7"):
        vocab.choose(counts, 8)
    ids = torch.tensor([1, 2, 4])
    assert vocab.d2t_of(ids).tolist() == [1, 1, 2] and vocab.ids_of(vocab.d2t_of(ids)).tolist() == [1, 2, 4]
    assert vocab.t2d_of(ids, 8).tolist() == [-1, 0, 1, -1, 2, -1, -1, -1]
    for bad, why in (([1, 1, 4], "repeats"), ([1, 2, 8], "lie in"), ([1, 2], "has 2 ids")):
        with pytest.raises(DflashError, match=why):
            vocab.check_ids(torch.tensor(bad), 3, 8, "x")


def test_plan_records_the_loss_token_counts_and_data_show_reports_coverage(tmp_path):
    from dflash_staged.manifest import Manifest

    mdir = plan(tmp_path, n=20, extra="[drafter]\ndraft_vocab_size = 256\n")
    rec = Manifest.open(mdir, readonly=True).meta["loss_tokens"]
    rows = [json.loads(x) for x in (tmp_path / "data.jsonl").read_text().splitlines()]
    counts = np.zeros(2048, dtype=np.int64)
    for r in rows:
        ids, mask = np.array(r["input_ids"]), np.array(r["loss_mask"])
        np.add.at(counts, ids[mask > 0], 1)
    assert vocab.counts_of(rec).tolist() == counts.tolist()
    want = vocab.choose(counts, 256)
    assert 0 < want.coverage < 1
    code, out = cli("data", "show", "--config", tmp_path / "cfg.toml", "--data", tmp_path / "data.jsonl")
    assert code == 0 and f"256 {want.coverage:.2%}" in out and "configured 256" in out, out


@pytest.mark.parametrize("arch", ["dflash2", "dspine"])
def test_a_family_that_cannot_take_a_draft_vocabulary_is_refused_at_plan(tmp_path, arch):
    data = write_dataset(tmp_path / "data.jsonl", n=4)
    extra = f'[drafter]\narchitecture = "{arch}"\ndraft_vocab_size = 256\n[target]\nstore_last_layer = true\n'
    cfg = write_config(tmp_path / "cfg.toml", extra)
    code, out = cli("plan", "--config", cfg, "--data", data, "--manifest", tmp_path / "m")
    assert code != 0 and f"a {arch} drafter cannot take a draft vocabulary" in out, out
    assert len(out.strip().splitlines()) == 1 and not (tmp_path / "m").exists()


def test_the_trainer_chooses_the_size_it_is_given_from_the_manifest_s_counts():
    from dflash_staged.train.trained_drafter import planned_vocab

    d = make_drafter(draft_vocab_size=N)
    with pytest.raises(DflashError, match=f"draft_vocab_size = {N}, but the manifest holds no loss-token"):
        planned_vocab(d.dcfg, None)
    counts = np.random.default_rng(0).poisson(3.0, V)
    rec = vocab.counts_record(counts)
    assert planned_vocab(d.dcfg, rec).tolist() == vocab.choose(counts, N).ids.tolist()
    assert planned_vocab(make_drafter().dcfg, rec) is None


@pytest.mark.parametrize("arch", ["dflash", "dspark"])
def test_the_checkpoint_holds_the_head_rows_and_d2t_as_the_engines_read_them(tmp_path, arch):
    from safetensors.torch import load_file

    from dflash_staged.model.drafters.backbone import DFlashDrafter
    from dflash_staged.model.drafters.weights import load_drafter, save_drafter

    ids = vocab_ids()
    opts = {"markov_rank": 8} if arch == "dspark" else {}
    d = make_drafter(architecture=arch, draft_vocab_size=N, options=opts)
    g = torch.Generator().manual_seed(1000)  # make_drafter's target tensors
    embed, head = torch.randn(V, 64, generator=g), torch.randn(V, 64, generator=g) * 0.2
    d.set_draft_vocab(ids, head)
    save_drafter(d, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == N and cfg["vocab_size"] == V
    state = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert state["d2t"].dtype == torch.int64 and torch.equal(state["d2t"] + torch.arange(N), ids)
    assert torch.equal(state["lm_head.weight"], head[ids]) and "t2d" not in state
    if arch == "dspark":
        assert tuple(state["markov_head.markov_w2.weight"].shape) == (N, 8)
        assert tuple(state["markov_head.markov_w1.weight"].shape) == (V, 8)
    back = load_drafter(tmp_path / "ck", embed, head)
    assert torch.equal(back.to_target(torch.arange(N)), ids) and torch.equal(back.lm_head_weight, head[ids])
    full = make_drafter(architecture=arch, options=opts)  # without one: no head saved, V rows
    assert "lm_head.weight" not in full.state_dict() and full.lm_head_weight.shape[0] == V
    with pytest.raises(DflashError, match="repeats a target id"):
        DFlashDrafter(d.dcfg, embed, head, torch.cat([ids[:-1], ids[:1]]))


def test_the_loss_is_the_ce_over_the_vocabulary_with_labels_outside_masked():
    ids = vocab_ids(120)
    d = make_drafter(draft_vocab_size=120, block=4)
    d.set_draft_vocab(ids, make_drafter(block=4).lm_head_weight)
    batch = packed_batch([30, 41])
    half = batch["input_ids"].clone()
    half[::2] = ids[torch.arange(half[::2].numel()) % 120]  # every other token inside, the rest mostly not
    batch["input_ids"] = half
    loss, stats = dflash_loss(d, batch, 6, gamma=4.0, generator=torch.Generator().manual_seed(3))
    anchors = sample_anchors(batch["loss_mask"], batch["cu_seqlens"], 4, 6, torch.Generator().manual_seed(3))
    labels, valid = block_labels(half, batch["loss_mask"], batch["cu_seqlens"], anchors, 4)
    t2d = vocab.t2d_of(ids, V)
    inside = t2d[labels] >= 0
    with torch.no_grad():
        h = d.forward_train(batch["hidden"], half, batch["cu_seqlens"], anchors)[:, 1:]
        logq = F.log_softmax(h @ d.lm_head_weight.t(), -1)
    ce = -logq.gather(-1, t2d[labels].clamp_min(0)[..., None])[..., 0]
    w = torch.exp(-torch.arange(3.0) / 4.0)[None] * (valid & inside)
    assert float(loss.detach()) == pytest.approx(float((w * ce).sum() / w.sum()), rel=1e-5)
    assert int(stats["label_oov"]) == int((valid & ~inside).sum()) > 0
    assert int(stats["total"].sum()) == int(valid.sum())  # a label outside still counts (as a miss)


def test_topk_over_a_draft_vocabulary_is_the_target_renormalised_there():
    from dflash_staged.model.drafters.distill_head import acceptance

    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, V, generator=g) * 3
    logp = F.log_softmax(z, -1)
    ids = vocab_ids(60)
    t2d = vocab.t2d_of(ids, V)
    logq = F.log_softmax(torch.randn(5, 60, generator=g), -1)
    # every id stored: exactly the target restricted to the vocabulary and renormalised
    lp, order = logp.sort(-1, descending=True)
    full = TopK(order, lp, torch.full((5,), float("-inf"))).restrict(t2d)
    want = F.softmax(z[:, ids], -1)
    assert torch.allclose(topk_logp(logq, full).exp(), want, atol=1e-6)
    # the top 16: the kept entries in proportion, the tail as all inside, dropped entries ignored
    top = TopK(order[:, :16], lp[:, :16], torch.logsumexp(lp[:, 16:], -1)).restrict(t2d)
    inside = t2d[order[:, :16]] >= 0
    kept = torch.where(inside, lp[:, :16].exp(), 0.0).sum(-1)
    r = lp[:, 16:].exp().sum(-1)
    assert torch.allclose(top.tail().exp(), r / (kept + r), atol=1e-6)
    p = topk_logp(logq, top).exp()
    assert torch.allclose(p.sum(-1), torch.ones(5), atol=1e-5)
    for i in range(5):
        k = order[i, :16][inside[i]]
        assert torch.allclose(p[i, t2d[k]], logp[i, k].exp() / (kept[i] + r[i]), atol=1e-6)
        assert torch.equal(top.ids[i, 0], t2d[k[0]])  # the target's argmax inside comes first
        # the overlap ignores the dropped entries: as if only the kept ones had been stored
        m = int(inside[i].sum())
        alone = TopK(top.ids[i : i + 1, :m], top.logp[i : i + 1, :m], top.tail()[i : i + 1])
        q = logq[i : i + 1].exp()
        assert torch.allclose(
            acceptance(p[i : i + 1], q, top.rows(torch.tensor([i]))), acceptance(p[i : i + 1], q, alone)
        )


def test_eval_drafts_over_the_vocabulary_and_stays_lossless(tmp_path):
    from dflash_staged.config import load_config
    from dflash_staged.evaluate.sampling import Sampler, SamplingSettings, SparseQ
    from dflash_staged.evaluate.speculative import DrafterProposer, greedy_generate, speculative_generate
    from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
    from dflash_staged.model.target.weights import load_embed_and_head

    from helpers import TINY, tiny_target

    target = tiny_target()
    cfg = load_config(TINY)
    embed, head = load_embed_and_head(cfg.target)
    ids = torch.arange(4, 2048, 5)  # 409 of the 2,048 tokens
    for arch, opts in (("dflash", {}), ("dspark", {"markov_rank": 8})):
        cfg.drafter.architecture, cfg.drafter.options = arch, opts
        cfg.drafter.draft_vocab_size = ids.numel()
        dcfg = DraftModelConfig.from_config(cfg, 128, 2048, 6, target.layer_ids, 3)
        torch.manual_seed(0)
        d = DFlashDrafter(dcfg, embed, head, ids)
        prompt = torch.arange(10, 30)
        want = greedy_generate(target, prompt, 24)
        got = speculative_generate(target, DrafterProposer(d), prompt, 24)
        assert got.tokens == want  # greedy: identical to the target's own decoding
        sampler = Sampler(SamplingSettings(temperature=1.0, seed=0))
        prop = DrafterProposer(d)
        context = target.forward_with_taps(prompt[None])[1][0]
        drafts, q = prop.propose(context[:-1], prompt, sampler)
        assert isinstance(q, SparseQ) and torch.isin(drafts, ids).all()
        assert torch.isin(q.ids, ids).all() and torch.allclose(q.probs.sum(-1), torch.ones(len(drafts)))


def test_the_memory_estimate_counts_the_head_s_rows(tmp_path):
    from dflash_staged.train.memory import estimate

    full, small = make_drafter(device="meta"), make_drafter(device="meta", draft_vocab_size=N)
    cfg = write_config(tmp_path / "cfg.toml", "[drafter]\ndraft_vocab_size = 256\n")
    code, out = cli("memory", "--config", cfg)
    assert code == 0 and "loss chunk" in out, out
    from dflash_staged.config import load_config

    t = load_config(cfg).train
    cpu = torch.device("cpu")
    assert estimate(small, t, cpu).loss * V == estimate(full, t, cpu).loss * N
