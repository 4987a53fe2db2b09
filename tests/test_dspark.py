"""DSpark: the anchor-first layout, the Markov head's variants, the objective and the served decode, each
against a computation written out by hand here; the checkpoint as the runtimes read it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dflash_staged.errors import DflashError
from dflash_staged.evaluate.speculative import DrafterProposer, greedy_generate, speculative_generate
from dflash_staged.model.drafters.config import DraftModelConfig
from dflash_staged.model.drafters.dspark.objective import dspark_objective
from dflash_staged.model.drafters.family import FamilyBatch
from dflash_staged.model.drafters.weights import load_drafter, save_drafter
from dflash_staged.model.target.weights import FinalNorm
from dflash_staged.train.objective import dflash_loss, sample_anchors

from helpers import make_drafter

B = 5


def dspark(kind="vanilla", rank=8, seed=0, **opts):
    torch.manual_seed(seed)
    d = make_drafter(
        architecture="dspark",
        block=B,
        k_taps=2,
        options={"markov_rank": rank, "markov_head_type": kind, **opts},
    )
    with torch.no_grad():  # a Markov head and confidence head that matter
        for p in d.parameters():
            if p.dim() == 1 and p.shape[0] < 16:
                p.add_(0.1)
        if rank:
            d.markov_head.markov_w2.weight.normal_(0, 0.5)
    return d


def batch(d, T=40, cu=(0, 25, 40), seed=1):
    g = torch.Generator().manual_seed(seed)
    H = d.dcfg.hidden_size
    mask = torch.ones(T)
    mask[[3, 17, 30]] = 0
    return dict(
        hidden=torch.randn(T, 3, H, generator=g),
        input_ids=torch.randint(0, d.dcfg.vocab_size - 1, (T,), generator=g),
        loss_mask=mask,
        cu_seqlens=torch.tensor(cu),
    )


def test_every_block_row_is_a_proposal_and_the_verify_checks_b_drafts():
    d = dspark()
    assert (d.first_row, d.proposals) == (0, B)
    ctx = torch.randn(9, 2, d.dcfg.hidden_size)
    logits = d.draft_block(ctx, 7)
    assert logits.shape == (B, d.dcfg.vocab_size)  # rows 0..B-1, the anchor's row first
    assert DrafterProposer(d).block_size == B + 1  # the anchor and B drafts


def test_the_layout_is_written_and_a_dflash_layout_checkpoint_is_refused(tmp_path):
    d = dspark()
    save_drafter(d, tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["sample_from_anchor"] is True
    assert cfg["is_causal"] is False and cfg["block_size"] == B
    assert (cfg["markov_rank"], cfg["markov_head_type"]) == (8, "vanilla")
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    assert cfg["target_layer_ids"] == cfg["dflash_config"]["target_layer_ids"] == [1, 3]
    cfg["sample_from_anchor"] = False
    with pytest.raises(DflashError, match="sample_from_anchor is false.*DFlash's layout"):
        DraftModelConfig.from_dict(cfg)


def test_checkpoint_names_and_round_trip(tmp_path):
    d = dspark("gated")
    save_drafter(d, tmp_path / "c")
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "c" / "model.safetensors")))
    assert {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "markov_head.gate_proj.weight",
        "markov_head.gate_proj.bias",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    } <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    V, r, H = d.dcfg.vocab_size, 8, d.dcfg.hidden_size
    sd = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert sd["markov_head.markov_w1.weight"].shape == sd["markov_head.markov_w2.weight"].shape == (V, r)
    assert sd["confidence_head.proj.weight"].shape == (1, H + r)
    back = load_drafter(tmp_path / "c", d.embed_weight, d.lm_head_weight)
    ctx = torch.randn(9, 2, H)
    torch.testing.assert_close(back.draft_block(ctx, 7), d.draft_block(ctx, 7))


def test_deepspec_style_config_is_read_and_a_missing_field_is_named(tmp_path):
    d = dspark()
    flat = d.dcfg.to_dict()
    flat.pop("dflash_config")  # DeepSpec's files carry the fields at the top level only
    back = DraftModelConfig.from_dict(flat)
    assert (
        back.architecture == "dspark" and back.target_layer_ids == [1, 3] and back.options["markov_rank"] == 8
    )
    flat.pop("enable_confidence_head")
    with pytest.raises(DflashError, match="needs the field 'enable_confidence_head'"):
        DraftModelConfig.from_dict(flat)


def hand_latents(head, kind, prev, h):
    """The Markov latents written out: [A, P] prev tokens, [A, P, H] states -> [A, P, r]."""
    w1 = head.markov_w1.weight
    out = torch.zeros(*prev.shape, w1.shape[1])
    for a in range(prev.shape[0]):
        s = torch.zeros(w1.shape[1])
        for k in range(prev.shape[1]):
            e = w1[prev[a, k]]
            if kind == "vanilla":
                out[a, k] = e
            elif kind == "gated":
                g = torch.sigmoid(head.gate_proj.weight @ torch.cat([h[a, k], e]) + head.gate_proj.bias)
                out[a, k] = g * e
            else:
                z = head.joint_proj.weight @ torch.cat([s, e, h[a, k]]) + head.joint_proj.bias
                gr, c, o = z.chunk(3)
                s = torch.sigmoid(gr) * s + (1 - torch.sigmoid(gr)) * torch.tanh(c)
                out[a, k] = torch.tanh(o)
    return out


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_variants_equal_the_hand_recurrence(kind):
    d = dspark(kind)
    g = torch.Generator().manual_seed(3)
    prev = torch.randint(0, d.dcfg.vocab_size, (3, B), generator=g)
    h = torch.randn(3, B, d.dcfg.hidden_size, generator=g)
    m, e = d.markov_head.latents(prev, h)
    with torch.no_grad():
        torch.testing.assert_close(m, hand_latents(d.markov_head, kind, prev, h), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(e, d.markov_head.markov_w1.weight[prev])


def hand_objective(d, b, anchors, gamma, norm):
    """The DSpark objective row by row with full-vocabulary logits (no chunking, no checkpoint)."""
    o = d.dcfg.options
    ids, mask, cu = b["input_ids"], b["loss_mask"], b["cu_seqlens"]
    out = d.forward_train(b["hidden"][:, :2], ids, cu, anchors)
    W, total, wsum = d.lm_head_weight, 0.0, 0.0
    for i, a in enumerate(anchors.tolist()):
        end = int(cu[int((cu <= a).sum()) - 1 + 1])
        prevs = [ids[a]] + [ids[min(a + k, len(ids) - 1)] for k in range(1, B)]
        m, e = d.markov_head.latents(torch.stack(prevs)[None], out[i][None])
        conf = d.confidence_head.proj(torch.cat([out[i], e[0]], -1)).squeeze(-1)
        ok = True
        for k in range(B):
            pos = a + k + 1
            ok = ok and pos < end and mask[pos] > 0
            if not ok:
                break
            u = W @ out[i, k] + d.markov_head.markov_w2.weight @ m[0, k]
            q = torch.softmax(u, -1)
            p = torch.softmax(W @ norm(b["hidden"][a + k, 2]), -1)
            ce = -torch.log_softmax(u, -1)[ids[pos]]
            l1 = (q - p).abs().sum()
            acc = (1 - 0.5 * l1.detach()).clamp(0, 1)
            bce = F.binary_cross_entropy_with_logits(conf[k], acc)
            w = torch.exp(torch.tensor(-k / gamma))
            total = total + w * (o["ce_weight"] * ce + o["l1_weight"] * l1 + o["confidence_weight"] * bce)
            wsum = wsum + w
    return total, wsum


@pytest.mark.parametrize("chunk", [7, 4096])
def test_objective_and_gradients_equal_the_hand_computation(chunk):
    d = dspark("rnn", seed=2)
    b = batch(d)
    norm = FinalNorm(torch.rand(d.dcfg.hidden_size) + 0.5, 1e-6)
    anchors = sample_anchors(b["loss_mask"], b["cu_seqlens"], B, 4, torch.Generator().manual_seed(5))
    fb = FamilyBatch(
        d, b["hidden"][:, :2], b["input_ids"], b["loss_mask"], b["cu_seqlens"], anchors, b["hidden"][:, 2],
        norm, "sdpa", 0, 0, chunk, None, 4.0,
    )  # fmt: skip
    total, rows = dspark_objective(fb)
    total.backward()
    mine = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    d.zero_grad()
    want, wsum = hand_objective(d, b, anchors, 4.0, norm)
    want.backward()
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows.weight_sum, torch.as_tensor(wsum).float(), rtol=1e-6, atol=1e-6)
    assert {"markov_head.markov_w2.weight", "confidence_head.proj.weight", "fc.weight"} <= set(mine)
    for n, p in d.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(mine[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_a_dspark_drafter_without_the_last_layer_is_refused_before_a_step():
    d = dspark()
    b = batch(d)
    b["hidden"] = b["hidden"][:, :2]
    with pytest.raises(DflashError, match="'dspark' learns from the target's distribution.*store_last_layer"):
        dflash_loss(d, b, 4, 4.0)


def hand_walk(d, logits, hidden, anchor, threshold=0.0):
    prev, drafts, conf = int(anchor), [], []
    s = None
    for k in range(logits.shape[0]):
        m, e, s = d.markov_head.step(torch.tensor(prev), hidden[k], s)
        row = logits[k] + d.markov_head.markov_w2.weight @ m
        conf.append(float(torch.sigmoid(d.confidence_head.proj(torch.cat([hidden[k], e])))))
        prev = int(row.argmax())
        drafts.append(prev)
    n = next((k for k, c in enumerate(conf) if c < threshold), len(drafts)) if threshold else len(drafts)
    return drafts[:n]


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_greedy_decode_applies_the_markov_head_left_to_right(threshold):
    d = dspark("rnn", seed=4).eval()
    ctx, anchor = torch.randn(9, 2, d.dcfg.hidden_size), 11
    with torch.no_grad():
        logits, hidden = d.draft_block(ctx, anchor, return_hidden=True)
        drafts, q = d.family.walk(d, logits, hidden, torch.tensor(anchor), confidence_threshold=threshold)
        assert q is None and drafts.tolist() == hand_walk(d, logits, hidden, anchor, threshold)


def test_sampled_decode_draws_from_the_corrected_rows():
    d = dspark(seed=6).eval()
    ctx, anchor = torch.randn(9, 2, d.dcfg.hidden_size), 11
    with torch.no_grad():
        logits, hidden = d.draft_block(ctx, anchor, return_hidden=True)
        drafts, q = d.family.walk(
            d, logits, hidden, torch.tensor(anchor), 1.0, torch.Generator().manual_seed(0)
        )
        assert q.shape == logits.shape and torch.allclose(q.sum(-1), torch.ones(B))
        prev = anchor
        for k in range(B):  # each row: softmax of the logits plus the bias of the previous *draft*
            row = logits[k] + d.markov_head.markov_w2.weight @ d.markov_head.markov_w1.weight[prev]
            torch.testing.assert_close(q[k], torch.softmax(row, -1))
            prev = int(drafts[k])


def test_speculative_decoding_with_dspark_is_lossless():
    from test_evaluate import tiny_target

    target = tiny_target()
    torch.manual_seed(0)
    d = make_drafter(
        architecture="dspark", block=4, k_taps=2, hidden=target.hidden_size, vocab=target.vocab_size,
        options={"markov_rank": 4},
    )  # fmt: skip
    prop = DrafterProposer(d.eval())
    ids = torch.randint(0, 100, (7,))
    out = speculative_generate(target, prop, ids, 20)
    assert out.tokens == greedy_generate(target, ids, 20)
    assert (
        all(1 <= k <= 5 for k in out.accepted)
        and max(out.verified) == 5
        and len(out.verified) == len(out.accepted)
    )
