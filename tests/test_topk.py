"""The target's top-k log-probabilities as its distribution (issue 40): the tail as one bucket, each term
against the full-vocabulary value where the tail is known and against the bucketed value by hand;
the store's arrays; extract's computation; and the trainer's refusals."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.target_dist import topk_logp
from dflash_staged.train.objective.head import TargetRows, TopkRows, head_rows
from dflash_staged.train.objective.terms import TERMS, Chunk

V, H = 40, 16
DIST_TERMS = ["ce_target", "kl", "rkl", "jsd", "tv", "lk", "lk_alpha"]


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


def rows(n=6, seed=0, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, H, generator=g, dtype=torch.float64)
    h = torch.randn(n, H, generator=g, dtype=torch.float64)
    last = sharp * torch.randn(n, H, generator=g, dtype=torch.float64)
    return W, h, last


def topk_of(t, k, T=1.0):
    v, i = torch.log_softmax(t / T, -1).topk(k, dim=-1)
    return i, v


@pytest.mark.parametrize("name", DIST_TERMS)
def test_each_term_over_topk_equals_the_full_vocabulary_value_when_k_covers_it(name):
    """k = V: through the chunked head (fp32), values, gradients to the drafter's states, the target's
    argmax and overlap equal the full-vocabulary computation from the last layer."""
    W, h, last = rows(seed=len(name))
    T = 1.5 if name in ("kl", "jsd") else 1.0
    pos = torch.arange(h.shape[0])
    ids, lp = topk_of((last @ W.T), V, T)
    labels = torch.zeros(h.shape[0], dtype=torch.long)
    out = {}
    for src in ("full", "topk"):
        x = h.clone().requires_grad_(True)
        target = TargetRows(last, pos, Identity()) if src == "full" else TopkRows(ids, lp, pos)
        r = head_rows(x, W, labels, 4, terms={name: 1.0}, target=target, temperature=T)
        r.loss.sum().backward()
        out[src] = (r.loss.detach(), x.grad, r.target_ids) + ((r.overlap,) if T == 1.0 else ())
    for a, b in zip(out["full"], out["topk"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the head computes in fp32


@pytest.mark.parametrize("name", DIST_TERMS)
@pytest.mark.parametrize("k", [V, V - 1])
def test_each_terms_value_and_gradient_are_exact_where_the_tail_is_known(name, k):
    """k = V (no tail) and k = V - 1 (a tail of one token: the bucket is that token), in float64."""
    W, h, last = rows(seed=len(name) + k, sharp=0.3)
    u, t = h @ W.T, last @ W.T
    T = 1.5 if name in ("kl", "jsd") else 1.0
    y = torch.zeros(h.shape[0], dtype=torch.long)
    full = TERMS[name].fn(Chunk(u, y, t, T, 3.0))
    top = TERMS[name].fn(Chunk(u, y, None, T, 3.0, top=topk_of(t, k, T)))
    for a, b in zip(full, top):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def bucketed(name, u, ids, lp, T, eta=3.0):
    """The term of the two distributions bucketed as (the k ids, the tail), written out (autograd)."""
    q = torch.softmax(u / T, -1)
    qk, pk = q.gather(1, ids), lp.exp()
    qb, pb = (
        torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], 1),
        torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], 1),
    )
    kl = (pb * (pb.log() - qb.log())).sum(-1)
    tv = 0.5 * (pb - qb).abs().sum(-1)
    if name == "kl":
        return kl
    if name == "rkl":
        return (qb * (qb.log() - pb.log())).sum(-1)
    if name == "jsd":
        m = (pb + qb) / 2
        return 0.5 * ((pb * (pb.log() - m.log())).sum(-1) + (qb * (qb.log() - m.log())).sum(-1))
    if name == "tv":
        return tv
    alpha = 1 - tv
    if name == "lk":
        lam = torch.exp(-eta * alpha.detach())
        return lam * kl + (1 - lam) * tv
    return -alpha.clamp_min(1e-5).log()  # lk_alpha


@pytest.mark.parametrize("name", ["kl", "rkl", "jsd", "tv", "lk", "lk_alpha"])
@pytest.mark.parametrize("k", [3, 12])
def test_each_term_over_topk_is_the_bucketed_term_value_and_gradient(name, k):
    """With a real tail: the value and the gradient in the drafter's logits are those of the term on
    the bucketed distributions (the k ids one by one, the tail as one outcome), computed by autograd."""
    g = torch.Generator().manual_seed(k)
    u = torch.randn(5, V, generator=g, dtype=torch.float64) * 2
    t = torch.randn(5, V, generator=g, dtype=torch.float64) * 2
    T = 1.3
    ids, lp = topk_of(t, k, T)
    c = Chunk(u, torch.zeros(5, dtype=torch.long), None, T, 3.0, top=(ids, lp))
    value, grad = TERMS[name].fn(c)
    x = u.clone().requires_grad_(True)
    want = bucketed(name, x, ids, lp, T)
    want.sum().backward()
    torch.testing.assert_close(value, want.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, x.grad, rtol=1e-7, atol=1e-10)
    full = Chunk(u, torch.zeros(5, dtype=torch.long), t, T, 3.0)
    if name in ("kl", "rkl", "jsd", "tv"):  # the bucketed divergence is below the full one
        assert bool((value <= TERMS[name].fn(full)[0] + 1e-12).all())


def test_topk_logp_spreads_the_tail_like_the_drafter():
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    ids, lp = torch.tensor([[3]]), torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    p = topk_logp(q, ids, lp).exp()
    torch.testing.assert_close(p, torch.tensor([[0.5 / 6, 1 / 6, 1.5 / 6, 0.5]], dtype=torch.float64))


def test_extracts_topk_is_the_targets_log_softmax(tmp_path):
    from dflash_staged.config import TargetConfig
    from dflash_staged.model.target import load_target

    tcfg = TargetConfig(model="tiny:qwen3", store_topk=8, topk_temperature=0.7)
    target = load_target(tcfg, "cpu", layer_ids=[1, 3])
    assert target.captured_ids == [1, 3, target.num_layers - 1] and target.stored_ids == [1, 3]
    ids = torch.randint(4, 2000, (1, 21), generator=torch.Generator().manual_seed(0))
    hidden = target.capture(ids)[0]
    got_ids, got_lp = target.topk_of(hidden[:, -1], chunk=5)
    logits = target.model(ids).logits[0].float()
    want_lp, want_ids = torch.log_softmax(logits / 0.7, -1).topk(8, -1)
    assert torch.equal(got_ids.long(), want_ids) and got_lp.dtype == torch.float16
    torch.testing.assert_close(got_lp.float(), want_lp, atol=2e-2, rtol=2e-3)  # fp16 storage


def test_a_store_with_topk_round_trips_and_checks_its_arrays(tmp_path):
    from dflash_staged.store import ShardCorruptError, ShardStore, StoreMeta

    meta = StoreMeta("m", "t", [1, 3], 8, "float32", topk=4, topk_temperature=1.0)
    store = ShardStore.create_or_open(tmp_path / "s", meta)
    T = 9
    hidden = torch.randn(T, 2, 8)
    top = (torch.randint(0, 100, (T, 4), dtype=torch.int32), torch.randn(T, 4).to(torch.float16))
    info = store.write_shard(0, 5, hidden, torch.arange(T), torch.ones(T), [0, 4, T], [7, 8], topk=top)
    shard = store.read_shard(0, 5, info.checksum)
    assert torch.equal(shard.topk_ids, top[0]) and torch.equal(shard.topk_logprobs, top[1])
    files = sum(f.stat().st_size for f in store.shard_path(0, 5).rglob("c*") if f.is_file())
    assert files == store.estimate_nbytes(T, 2) == info.nbytes  # the size formula is the files on disk
    assert store.bytes_per_token == 2 * 8 * 4 + 4 * 6 + 5
    with pytest.raises(ValueError, match="holds the target's top-4"):
        store.write_shard(0, 6, hidden, torch.arange(T), torch.ones(T), [0, 4, T], [7, 8])
    f = store.shard_path(0, 5) / "topk_logprobs" / "c.0.0"
    data = bytearray(f.read_bytes())
    data[3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match="topk_logprobs fails its checksum"):
        store.read_shard(0, 5)


def test_dspark_and_dspine_over_topk_equal_their_full_vocabulary_objectives():
    """k = V: the families' objectives from the top-k equal those from the last layer (values, grads)."""
    import sys

    sys.path.insert(0, "tests")
    from dflash_staged.model.drafters.family import FamilyBatch
    from dflash_staged.model.target.weights import FinalNorm
    from dflash_staged.train.objective import sample_anchors

    from helpers import make_drafter

    for arch, opts in [("dspark", {"markov_rank": 4}), ("dspine", {"transfer_rank": 8, "message_size": 8})]:
        torch.manual_seed(0)
        d = make_drafter(architecture=arch, block=5, k_taps=2, vocab=64, options=opts).double()
        g = torch.Generator().manual_seed(1)
        Tn, Hd = 30, d.dcfg.hidden_size
        taps, last = torch.randn(Tn, 2, Hd, generator=g).double(), torch.randn(Tn, Hd, generator=g).double()
        ids = torch.randint(0, 63, (Tn,), generator=g)
        mask, cu = torch.ones(Tn), torch.tensor([0, Tn])
        norm = FinalNorm(torch.ones(Hd), 1e-6).double()
        anchors = sample_anchors(mask, cu, 5, 4, torch.Generator().manual_seed(2))
        t = norm(last) @ d.lm_head_weight.T
        top = topk_of(t, 64)
        out = {}
        for src in ("full", "topk"):
            d.zero_grad()
            fb = FamilyBatch(
                d, taps, ids, mask, cu, anchors, last if src == "full" else None, norm, "sdpa", 1, 10, 7,
                torch.Generator().manual_seed(3), 4.0, None if src == "full" else top,
            )  # fmt: skip
            total, rows_ = d.family.objective(fb)
            total.backward()
            out[src] = (
                total.detach(),
                {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None},
            )
        torch.testing.assert_close(out["full"][0], out["topk"][0], rtol=1e-5, atol=1e-6, msg=arch)
        for n, gr in out["full"][1].items():  # (the objectives' head runs in fp32)
            torch.testing.assert_close(gr, out["topk"][1][n], rtol=1e-4, atol=1e-6, msg=f"{arch} {n}")


def test_a_target_loss_over_a_store_with_neither_slice_is_refused_naming_both(tmp_path):
    from types import SimpleNamespace

    from dflash_staged.config import load_config
    from dflash_staged.store import StoreMeta
    from dflash_staged.train.trained_drafter import target_norm_for

    cfg = load_config("configs/tiny.toml")
    cfg.train.loss = {"tv": 1.0}
    bare = SimpleNamespace(root=tmp_path, meta=StoreMeta("m", "t", [1], 8, "float32"))
    with pytest.raises(DflashError, match=r"store_last_layer = true or \[target\] store_topk = 64"):
        target_norm_for(cfg, bare, torch.device("cpu"))
    hot = SimpleNamespace(
        root=tmp_path, meta=StoreMeta("m", "t", [1], 8, "float32", topk=16, topk_temperature=2.0)
    )
    with pytest.raises(DflashError, match="train.distill_temperature = 1, but .* topk_temperature = 2"):
        target_norm_for(cfg, hot, torch.device("cpu"))
    cfg.train.distill_temperature = 2.0
    assert target_norm_for(cfg, hot, torch.device("cpu")) is None  # the top-k serve the terms
    cfg.drafter.architecture = "dspark"
    with pytest.raises(DflashError, match="'dspark' learns the target's distribution at temperature 1"):
        target_norm_for(cfg, hot, torch.device("cpu"))
