"""The target's top-k log-probabilities as its distribution (issue 40): the tail as one bucket, each term
against the full-vocabulary value where the tail is known and against the bucketed value by hand;
the store's arrays; extract's computation; and the trainer's refusals."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.target_dist import TopK, topk_logp
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
    """The top-k as extract stores it: ids, log-probabilities and the tail's log-mass (log space)."""
    z = t / T
    lse = torch.logsumexp(z, -1)
    v, i = z.topk(k, dim=-1)
    return TopK(i, v - lse[:, None], torch.logsumexp(z.scatter(1, i, float("-inf")), -1) - lse)


@pytest.mark.parametrize("name", DIST_TERMS)
def test_each_term_over_topk_equals_the_full_vocabulary_value_when_k_covers_it(name):
    """k = V: through the chunked head (fp32), values, gradients to the drafter's states, the target's
    argmax and overlap equal the full-vocabulary computation from the last layer."""
    W, h, last = rows(seed=len(name))
    T = 1.5 if name in ("kl", "jsd") else 1.0
    pos = torch.arange(h.shape[0])
    top = topk_of((last @ W.T), V, T)
    labels = torch.zeros(h.shape[0], dtype=torch.long)
    out = {}
    for src in ("full", "topk"):
        x = h.clone().requires_grad_(True)
        target = TargetRows(last, pos, Identity()) if src == "full" else TopkRows(top, pos)
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


def bucketed(name, u, top, T, eta=3.0):
    """The term of the two distributions bucketed as (the k ids, the tail), written out (autograd), in
    float64: the tail's masses from the logits outside the ids, the stored top-k scaled to 1 - r."""
    z = u / T
    lse = torch.logsumexp(z, -1, keepdim=True)
    qk = (z.gather(1, top.ids) - lse).exp()
    q_rest = (torch.logsumexp(z.scatter(1, top.ids, float("-inf")), -1, keepdim=True) - lse).exp()
    r = top.logtail.exp()[:, None]
    pk = top.logp.exp() / top.logp.exp().sum(-1, keepdim=True) * (1 - r)
    qb, pb = torch.cat([qk, q_rest], 1), torch.cat([pk, r], 1)
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
    if name == "overlap":
        return torch.minimum(pb, qb).sum(-1)
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
    top = topk_of(t, k, T)
    c = Chunk(u, torch.zeros(5, dtype=torch.long), None, T, 3.0, top=top)
    value, grad = TERMS[name].fn(c)
    x = u.clone().requires_grad_(True)
    want = bucketed(name, x, top, T)
    want.sum().backward()
    torch.testing.assert_close(value, want.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, x.grad, rtol=1e-7, atol=1e-10)
    full = Chunk(u, torch.zeros(5, dtype=torch.long), t, T, 3.0)
    if name in ("kl", "rkl", "jsd", "tv"):  # the bucketed divergence is below the full one
        assert bool((value <= TERMS[name].fn(full)[0] + 1e-12).all())


def test_topk_logp_spreads_the_tail_like_the_drafter():
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    ids, lp = torch.tensor([[3]]), torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    want = torch.tensor([[0.5 / 6, 1 / 6, 1.5 / 6, 0.5]], dtype=torch.float64)
    for tail in (torch.tensor([math.log(0.5)], dtype=torch.float64), None):  # stored, or derived (older)
        torch.testing.assert_close(topk_logp(q.log(), TopK(ids, lp, tail)).exp(), want)
    # the stored tail wins over the entries' sum: the entries are scaled to 1 - r
    p = topk_logp(q.log(), TopK(ids, lp, torch.tensor([math.log(0.4)], dtype=torch.float64))).exp()
    torch.testing.assert_close(p, torch.tensor([[0.4 / 6, 0.8 / 6, 1.2 / 6, 0.6]], dtype=torch.float64))


def test_fewer_than_stored_adds_the_dropped_entries_to_the_tail():
    t = torch.randn(4, V, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 3
    stored, want = topk_of(t, 12), topk_of(t, 5)
    got = stored.first(5)
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.logtail, want.logtail, rtol=1e-12, atol=1e-12)
    assert stored.first(0) is stored and stored.first(12) is stored


def test_extracts_topk_is_the_targets_log_softmax(tmp_path):
    from dflash_staged.config import TargetConfig
    from dflash_staged.model.target import load_target

    tcfg = TargetConfig(model="tiny:qwen3", store_topk=8, topk_temperature=0.7)
    target = load_target(tcfg, "cpu", layer_ids=[1, 3])
    assert target.captured_ids == [1, 3, target.num_layers - 1] and target.stored_ids == [1, 3]
    ids = torch.randint(4, 2000, (1, 21), generator=torch.Generator().manual_seed(0))
    hidden = target.capture(ids)[0]
    got_ids, got_lp, got_tail = target.topk_of(hidden[:, -1], chunk=5)
    logits = target.model(ids).logits[0].double()
    logp = torch.log_softmax(logits / 0.7, -1)
    want_lp, want_ids = logp.topk(8, -1)
    assert torch.equal(got_ids.long(), want_ids) and got_lp.dtype == torch.float16
    torch.testing.assert_close(got_lp.double(), want_lp, atol=2e-2, rtol=2e-3)  # fp16 storage
    want_tail = torch.logsumexp(logp.scatter(1, want_ids, float("-inf")), -1)
    assert got_tail.dtype == torch.float32
    torch.testing.assert_close(got_tail.double(), want_tail, atol=1e-5, rtol=1e-5)


def test_a_store_with_topk_round_trips_and_checks_its_arrays(tmp_path):
    from dflash_staged.store import ShardCorruptError, ShardStore, StoreMeta

    meta = StoreMeta("m", "t", [1, 3], 8, "float32", topk=4, topk_temperature=1.0, topk_tail=True)
    store = ShardStore.create_or_open(tmp_path / "s", meta)
    T = 9
    hidden = torch.randn(T, 2, 8)
    top = (
        torch.randint(0, 100, (T, 4), dtype=torch.int32),
        torch.randn(T, 4).to(torch.float16),
        -torch.rand(T) * 20,
    )
    info = store.write_shard(0, 5, hidden, torch.arange(T), torch.ones(T), [0, 4, T], [7, 8], topk=top)
    shard = store.read_shard(0, 5, info.checksum)
    assert torch.equal(shard.topk_ids, top[0]) and torch.equal(shard.topk_logprobs, top[1])
    assert torch.equal(shard.topk_logtail, top[2])
    files = sum(f.stat().st_size for f in store.shard_path(0, 5).rglob("c*") if f.is_file())
    assert files == store.estimate_nbytes(T, 2) == info.nbytes  # the size formula is the files on disk
    assert store.bytes_per_token == 2 * 8 * 4 + 4 * 6 + 4 + 5
    with pytest.raises(ValueError, match="give 3 top-k tensors"):
        store.write_shard(0, 6, hidden, torch.arange(T), torch.ones(T), [0, 4, T], [7, 8], topk=top[:2])
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


def test_the_acceptance_from_a_topk_is_exact_on_the_ids_and_half_the_tails_bound():
    """DSpark's acceptance target: k = V gives sum min(p, q); with a tail, the ids' part plus half of
    b = min(r, sum_tail min(q, p_k)), which bounds the tail's true part (tighter than the bucketed
    min(r, q_rest) where the drafter is sure of a token outside the top-k)."""
    from dflash_staged.model.drafters.distill_head import acceptance, overlap_parts

    g = torch.Generator().manual_seed(7)
    u = torch.randn(6, V, generator=g, dtype=torch.float64) * 2
    t = torch.randn(6, V, generator=g, dtype=torch.float64) * 2
    q, p = torch.softmax(u, -1), torch.softmax(t, -1)
    true = torch.minimum(p, q).sum(-1)
    full = topk_of(t, V)
    torch.testing.assert_close(acceptance(topk_logp(q.log(), full).exp(), q, full), true)
    for k in (3, 12):
        top = topk_of(t, k)
        pt = topk_logp(q.log(), top).exp()
        ids = top.ids
        on_ids = torch.minimum(p.gather(1, ids), q.gather(1, ids)).sum(-1)
        b = torch.minimum(
            torch.minimum(q, p.gather(1, ids[:, -1:])).scatter(1, ids, 0.0).sum(-1), top.logtail.exp()
        )
        torch.testing.assert_close(acceptance(pt, q, top), on_ids + b / 2)
        assert bool((on_ids <= true + 1e-12).all()) and bool((true <= on_ids + b + 1e-12).all())
    top = topk_of(t, 3)
    j = next(i for i in range(V) if not bool((top.ids == i).any()))
    u2 = u.clone()
    u2[:, j] = 8.0
    q2 = torch.softmax(u2, -1)
    pt = topk_logp(q2.log(), top).exp()
    on_ids, b = overlap_parts(pt, q2, top)
    assert bool((on_ids + b < torch.minimum(pt, q2).sum(-1) - 1e-3).all())  # tighter than bucketed
    assert bool((torch.minimum(p, q2).sum(-1) <= on_ids + b + 1e-12).all())


def test_a_candidate_outside_the_stored_topk_gets_no_target_mass():
    """DSpine's refinement target: the stored probability on a stored id, 0 elsewhere (not the tail's
    share in proportion to the drafter's own belief)."""
    from dflash_staged.model.drafters.distill_head import candidate_mass

    g = torch.Generator().manual_seed(8)
    t, u = torch.randn(4, V, generator=g) * 2, torch.randn(4, V, generator=g) * 2
    top = topk_of(t, 5)
    p = topk_logp(torch.log_softmax(u, -1), top).exp()
    cand = u.topk(6, -1).indices
    got = candidate_mass(p, cand, top)
    stored = (cand[:, :, None] == top.ids[:, None, :]).any(-1)
    assert bool((got[~stored] == 0).all()) and bool((got[stored] > 0).all())
    torch.testing.assert_close(got[stored], torch.softmax(t, -1).gather(1, cand)[stored])
    assert torch.equal(candidate_mass(p, cand, None), p.gather(1, cand))


def test_a_target_topk_above_the_stored_k_is_refused(tmp_path):
    from types import SimpleNamespace

    from dflash_staged.config import load_config
    from dflash_staged.store import StoreMeta
    from dflash_staged.train.trained_drafter import target_norm_for

    cfg = load_config("configs/tiny.toml")
    cfg.train.loss, cfg.train.target_topk = {"kl": 1.0}, 32
    store = SimpleNamespace(
        root=tmp_path,
        meta=StoreMeta("m", "t", [1], 8, "float32", topk=16, topk_temperature=1.0, topk_tail=True),
    )
    with pytest.raises(DflashError, match=r"train.target_topk = 32, but store .* holds its top-16: set"):
        target_norm_for(cfg, store, torch.device("cpu"))
    cfg.train.target_topk = 16
    assert target_norm_for(cfg, store, torch.device("cpu")) is None
    bare = SimpleNamespace(root=tmp_path, meta=StoreMeta("m", "t", [1], 8, "float32"))
    with pytest.raises(DflashError, match="holds no top-k"):
        target_norm_for(cfg, bare, torch.device("cpu"))


def test_a_store_written_before_the_tail_was_kept_reads_with_one_line(tmp_path, capsys):
    """An older store (no topk_logtail): the shards read, the loss takes the tail from the fp16 entries,
    and the trainer says so once, naming the store and the fix."""
    from types import SimpleNamespace

    from dflash_staged.config import load_config
    from dflash_staged.store import ShardStore, StoreMeta
    from dflash_staged.train.trained_drafter import target_norm_for

    meta = StoreMeta("m", "t", [1, 3], 8, "float32", topk=4, topk_temperature=1.0)  # as older stores read
    assert meta.arrays[-2:] == ("topk_ids", "topk_logprobs")
    store = ShardStore.create_or_open(tmp_path / "old", meta)
    T = 5
    top = (torch.randint(0, 100, (T, 4), dtype=torch.int32), torch.randn(T, 4).to(torch.float16))
    info = store.write_shard(
        0, 1, torch.randn(T, 2, 8), torch.arange(T), torch.ones(T), [0, T], [3], topk=top
    )
    shard = store.read_shard(0, 1, info.checksum)
    assert shard.topk_logtail is None and store.bytes_per_token == 2 * 8 * 4 + 4 * 6 + 5
    cfg = load_config("configs/tiny.toml")
    cfg.train.loss = {"kl": 1.0}
    assert (
        target_norm_for(cfg, SimpleNamespace(root=store.root, meta=store.meta), torch.device("cpu")) is None
    )
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "without the tail's mass" in err and "extract again into a new store" in err
    )
    lp = torch.log(torch.tensor([[0.5, 0.3]], dtype=torch.float64))
    torch.testing.assert_close(
        TopK(torch.tensor([[0, 1]]), lp).tail().exp(), torch.tensor([0.2], dtype=torch.float64)
    )


def test_the_topk_are_formed_with_the_runs_logit_transform_held_to_the_targets_config():
    """One function forms the target's logits for both routes: extract's top-k go through the run's
    softcap like the trainer's last-layer logits; a run whose settings differ from the target's config
    is refused in one line naming both."""
    import copy

    from dflash_staged.model.target.taps import Target
    from dflash_staged.model.target.tiny import build_tiny_model, tiny_config

    model = build_tiny_model("qwen3", seed=0, dtype=torch.float32)
    conf = copy.deepcopy(tiny_config("qwen3"))
    conf.final_logit_softcapping = 5.0
    with pytest.raises(DflashError, match=r"softcap 5 .* final_logit_softcapping = 0: set them to 1 and 5"):
        Target(model, [1, 3], "tiny", "cpu", conf, topk=8, logit_transform=(1.0, 0.0))
    target = Target(model, [1, 3], "tiny", "cpu", conf, topk=8, logit_transform=(1.0, 5.0))
    ids = torch.randint(4, 2000, (1, 9), generator=torch.Generator().manual_seed(0))
    got_ids, got_lp, _ = target.topk_of(target.capture(ids)[0][:, -1])
    logits = model(ids).logits[0].double()  # (HF's Qwen3 applies no softcap itself)
    want_lp, want_ids = torch.log_softmax(5.0 * torch.tanh(logits / 5.0), -1).topk(8, -1)
    assert torch.equal(got_ids.long(), want_ids)
    torch.testing.assert_close(got_lp.double(), want_lp, atol=2e-2, rtol=2e-3)


def test_extract_continues_an_older_store_without_the_tail(tmp_path, capsys):
    """A store begun before the tail was kept is continued alike (its shards without the tail), with
    one line; a new store keeps it."""
    from dflash_staged.extract.worker import _keeps_tail
    from dflash_staged.store import ShardStore, StoreMeta

    assert _keeps_tail(tmp_path / "new") and not capsys.readouterr().err
    old = StoreMeta("m", "t", [1], 8, "float32", topk=4, topk_temperature=1.0)
    ShardStore.create_or_open(tmp_path / "old", old)
    assert not _keeps_tail(tmp_path / "old")
    assert "started without the top-k's tail" in capsys.readouterr().err
    ShardStore.create_or_open(tmp_path / "old", old)  # reopened as written: no mismatch


def test_the_transform_is_held_to_the_config_only_where_the_topk_are_stored():
    import copy

    from dflash_staged.model.target.taps import Target
    from dflash_staged.model.target.tiny import build_tiny_model, tiny_config

    conf = copy.deepcopy(tiny_config("qwen3"))
    conf.final_logit_softcapping = 5.0
    t = Target(build_tiny_model("qwen3", seed=0), [1, 3], "tiny", "cpu", conf, logit_transform=(1.0, 0.0))
    assert t.logit_transform == (1.0, 5.0)  # no top-k: nothing stored depends on it
