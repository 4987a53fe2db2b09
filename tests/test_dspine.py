"""DSpine: the transfer space, the adjacent injection, the objective, the schedules and the refined walk,
each against a computation written out by hand here; the checkpoint as SpecForge exports it."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.config import DraftModelConfig
from dflash_staged.model.drafters.dspine.injection import transfer_space
from dflash_staged.model.drafters.dspine.objective import dspine_objective, schedule
from dflash_staged.model.drafters.family import FamilyBatch
from dflash_staged.model.drafters.weights import load_drafter, save_drafter
from dflash_staged.model.target.weights import FinalNorm
from dflash_staged.train.objective import sample_anchors

from helpers import make_drafter

B, R, M, K = 5, 16, 8, 4


def dspine(seed=0, live=True, **opts):
    torch.manual_seed(seed)
    d = make_drafter(
        architecture="dspine",
        block=B,
        k_taps=2,
        options={"transfer_rank": R, "message_size": M, "top_k": K, **opts},
    )
    if live:  # an injection that does something (it starts as the identity)
        with torch.no_grad():
            for w in d.injection.writes:
                w.weight.normal_(0, 0.3)
            d.injection.predecessor_gate.weight.normal_(0, 0.3)
    return d


def test_transfer_space_whitens_the_heads_top_directions():
    g = torch.Generator().manual_seed(0)
    head = torch.randn(300, 32, generator=g) * torch.linspace(0.2, 3, 32)
    codes, D = transfer_space(head, 8, chunk=70)
    n = F.normalize(head, dim=-1)
    mean = n.mean(0)
    S = (n - mean).T @ (n - mean)
    vals, vecs = torch.linalg.eigh(S.double())
    top = vals[-8:].float()
    torch.testing.assert_close((S @ D), D * top, atol=1e-3, rtol=1e-3)  # eigenvectors, top 8 eigenvalues
    C = (n - mean) @ D / top.sqrt()
    torch.testing.assert_close(C.T @ C, torch.eye(8), atol=1e-3, rtol=1e-3)  # whitened
    torch.testing.assert_close(codes, F.normalize(C, dim=-1), atol=1e-5, rtol=1e-5)


def test_a_fresh_dspine_drafter_is_a_causal_dflash_drafter():
    d = dspine(live=False)
    assert d.dcfg.is_causal is True and bool(d.transfer_ready)
    for r in d.injection.readouts:
        torch.testing.assert_close(r.weight, d.injection.readouts[0].weight)
    torch.manual_seed(0)
    plain = make_drafter(block=B, k_taps=2, is_causal=True)
    plain.load_state_dict({k: v for k, v in d.state_dict().items() if k in plain.state_dict()})
    ctx = torch.randn(9, 2, d.dcfg.hidden_size)
    torch.testing.assert_close(d.draft_block(ctx, 7), plain.draft_block(ctx, 7))


def hand_injection(d, x, layer, tokens, replace):
    """AdjacentInjection written out row by row: x [B, H], tokens [B]."""
    inj, codes, r = d.injection, d.transfer_codes, math.sqrt(R)

    def feat(v):
        return r * F.normalize(inj.readouts[layer].weight @ v, dim=-1)

    out = [x[0]]
    for j in range(1, x.shape[0]):
        if replace and layer < inj.replacement_layers:
            pred = r * codes[tokens[j - 1]]
        else:
            pred = r * codes[tokens[0]] if j == 1 else feat(x[j - 1])
        gate = torch.sigmoid(
            inj.receiver_gate.weight @ feat(x[j]) + inj.predecessor_gate.weight @ pred + inj.bias
        )
        delta = inj.writes[layer].weight @ (gate * (inj.message.weight @ pred))
        out.append(x[j] + x[j].norm() / math.sqrt(x.shape[-1]) * delta)
    return torch.stack(out)


@pytest.mark.parametrize("replace", [False, True])
def test_injection_equals_the_hand_rows(replace):
    d = dspine(replacement_layers=1)
    x = torch.randn(B, d.dcfg.hidden_size)
    tokens = torch.randint(0, d.dcfg.vocab_size, (B,))
    with torch.no_grad():
        for layer in range(2):
            got = d.injection(x, layer, tokens, d.transfer_codes, torch.tensor(replace))
            torch.testing.assert_close(
                got, hand_injection(d, x, layer, tokens, replace), atol=1e-5, rtol=1e-5
            )


def test_schedule_by_hand():
    o = dspine().dcfg.options  # warmup 146, p 0.5, hold 1/6, end 1/3
    assert schedule(o, 0, 600) == (0.0, 0.5)
    assert schedule(o, 73, 600) == (pytest.approx(0.25), 0.5)
    beta, rho = schedule(o, 150, 600)  # progress 1/4: halfway from hold to end
    assert beta == 0.5 and rho == pytest.approx(0.25)
    assert schedule(o, 400, 600) == (0.5, 0.0) and schedule(o, 10, 0)[1] == 0.0


def hand_objective(d, b, anchors, gamma, norm, replace, beta):
    """Every row by hand: the block through draft_block (the inference path, the data's tokens in the
    block), the four terms on full-vocabulary logits."""
    o, W = d.dcfg.options, d.lm_head_weight
    ids, mask, cu, H = b["input_ids"], b["loss_mask"], b["cu_seqlens"], b["hidden"]
    cw, L = o["ce_weight"], len(d.layers)
    ce = l1 = ref = ali = wsum = 0.0
    for i, a in enumerate(anchors.tolist()):
        start = int(cu[(cu <= a).sum() - 1])
        end = int(cu[(cu <= a).sum()])
        tokens = ids[torch.arange(a, a + B).clamp(max=len(ids) - 1)]
        state = {"block_tokens": tokens, "replace": torch.tensor(bool(replace[i]))}
        _, h = d.draft_block(H[start:a, :2], ids[a], anchor_pos=a - start, return_hidden=True, state=state)
        pre, feats = state["record"]["pre"], state["record"]["features"]
        ok = True
        for j in range(1, B):
            ok = ok and a + j < end and mask[a + j] > 0
            if not ok:
                break
            w = math.exp(-(j - 1) / gamma)
            y, prev = ids[a + j], ids[a + j - 1]
            u = W @ h[j - 1]
            p = torch.softmax(W @ norm(H[a + j - 1, 2]), -1).detach()
            c = -torch.log_softmax(u, -1)[y]
            dist = (torch.softmax(u, -1) - p).abs().sum()
            cand = u.detach().topk(K).indices
            from dflash_staged.model.drafters.dspine.injection import refine

            s = W[cand] @ refine(d, pre[j], prev)
            logr = torch.log_softmax(s, -1)
            rc = -logr[(cand == y).nonzero()[0, 0]] if (cand == y).any() else torch.tensor(0.0)
            tp = p[cand]
            rl = (logr.exp() - tp / tp.sum()).abs().sum() * (tp.sum() > o["candidate_mass_threshold"])
            code = d.transfer_codes[y]
            al = sum(1 - F.cosine_similarity(feats[layer][j], code, dim=0) for layer in range(L))
            ce, l1, ref, ali = ce + w * c, l1 + w * dist, ref + w * (cw * rc + (1 - cw) * rl), ali + w * al
            wsum += w
    return cw * ce + (1 - cw) * l1 + ref + beta * (ce.detach() / wsum) * ali, wsum


@pytest.mark.parametrize("step", [20, 400])
def test_objective_and_gradients_equal_the_hand_computation(step):
    d = dspine(seed=1)
    g = torch.Generator().manual_seed(2)
    T, Hs = 40, d.dcfg.hidden_size
    mask = torch.ones(T)
    mask[[3, 30]] = 0
    b = dict(
        hidden=torch.randn(T, 3, Hs, generator=g),
        input_ids=torch.randint(0, d.dcfg.vocab_size - 1, (T,), generator=g),
        loss_mask=mask,
        cu_seqlens=torch.tensor([0, 25, 40]),
    )
    norm = FinalNorm(torch.rand(Hs) + 0.5, 1e-6)
    anchors = sample_anchors(b["loss_mask"], b["cu_seqlens"], B, 4, torch.Generator().manual_seed(5))
    fb = FamilyBatch(
        d, b["hidden"][:, :2], b["input_ids"], b["loss_mask"], b["cu_seqlens"], anchors, b["hidden"][:, 2],
        norm, "sdpa", step, 600, 5, torch.Generator().manual_seed(9), 7.0,
    )  # fmt: skip
    total, rows = dspine_objective(fb)
    total.backward()
    mine = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    d.zero_grad()
    beta, rho = schedule(d.dcfg.options, step, 600)
    replace = torch.rand(anchors.shape, generator=torch.Generator().manual_seed(9)) < rho
    assert replace.any() == (step == 20)
    want, wsum = hand_objective(d, b, anchors, 7.0, norm, replace, beta)
    want.backward()
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)
    assert float(rows.weight_sum) == pytest.approx(wsum, rel=1e-6)
    assert {"injection.writes.0.weight", "injection.message.weight", "fc.weight"} <= set(mine)
    for n, p in d.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(mine[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_the_walk_is_the_argmax_path_over_all_transition_scores():
    """SpecForge's decode: scores of every (predecessor candidate, candidate) pair, then select."""
    from dflash_staged.model.drafters.dspine.injection import refine

    d = dspine(seed=3).eval()
    ctx, anchor = torch.randn(9, 2, d.dcfg.hidden_size), 11
    with torch.no_grad():
        state = {}
        logits, h = d.draft_block(ctx, anchor, return_hidden=True, state=state)
        drafts, q = d.family.walk(d, logits, h, torch.tensor(anchor), state=state)
        pre, W = state["record"]["pre"][1:], d.lm_head_weight
        cand = logits.topk(K, -1).indices
        scores = torch.zeros(B - 1, K, K)
        for i in range(B - 1):
            for k in range(K):
                prev = torch.tensor(anchor) if i == 0 else cand[i - 1, k]
                scores[i, k] = W[cand[i]] @ refine(d, pre[i], prev)
        index, want = 0, []
        for i in range(B - 1):
            index = int(scores[i, index].argmax())
            want.append(int(cand[i, index]))
    assert q is None and drafts.tolist() == want


def test_checkpoint_as_specforge_exports_it(tmp_path):
    d = dspine()
    save_drafter(d, tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["architectures"] == ["DSpineDraftModel"] and cfg["is_causal"] is True
    assert cfg["dspine_config"]["transfer_rank"] == R and set(cfg["dspine_config"]) == set(d.family.defaults)
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert sd["transfer_codes"].shape == (d.dcfg.vocab_size, R) and sd["transfer_ready"].dtype == torch.bool
    assert {"injection.readouts.1.weight", "injection.writes.1.weight", "injection.bias"} <= set(sd)
    back = load_drafter(tmp_path / "c", d.embed_weight, d.lm_head_weight)
    torch.testing.assert_close(back.transfer_codes, d.transfer_codes)
    ctx = torch.randn(9, 2, d.dcfg.hidden_size)
    torch.testing.assert_close(back.draft_block(ctx, 7), d.draft_block(ctx, 7))
    del cfg["dspine_config"]["top_k"]
    with pytest.raises(DflashError, match="needs the field 'top_k'"):
        DraftModelConfig.from_dict(cfg)


def test_bad_options_get_one_line():
    with pytest.raises(
        DflashError, match="drafter.options.transfer_rank=4096: must be at most the hidden size"
    ):
        dspine(transfer_rank=4096)
    with pytest.raises(DflashError, match="drafter.options.replacement_hold_ratio"):
        dspine(replacement_hold_ratio=0.5)
    with pytest.raises(DflashError, match="drafter.options.bogus: not an option of architecture 'dspine'"):
        dspine(bogus=1)
    with pytest.raises(DflashError, match="drafter.options.top_k='x': expected int"):
        dspine(top_k="x")
    with pytest.raises(DflashError, match="is_causal=False: a dspine drafter has is_causal=True"):
        make_drafter(architecture="dspine", is_causal=False, options={"transfer_rank": 8})
