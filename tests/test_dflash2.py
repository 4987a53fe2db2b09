"""DFlash2: identity start, block-local convolutions, the selector's walk and objective, D-PACE
weights, the checkpoint's names, shapes and config.json, and the logit transform."""

import json

import pytest
import torch
from safetensors import safe_open

from dflash_staged.model.drafters.config import DraftModelConfig
from dflash_staged.model.drafters.dflash2.modules import GroupedConv
from dflash_staged.model.drafters.weights import load_drafter, save_drafter
from dflash_staged.train.objective import dflash_loss, dpace_weights
from dflash_staged.train.objective.head import head_rows, top_values
from dflash_staged.train.objective.selector import alpha_at

from helpers import make_drafter, packed_batch
from refload import DFLASH2_REF, ZLAB_DFLASH2, zlab, zlab_lacks

ANCHORS = torch.tensor([3, 10, 20, 30, 41, 50])
V2 = dict(architecture="dflash2", conv_kernel_size=2, conv_group_size=8, selector_rank=16, selector_top_k=5)


def v2_like(v1, **fields):
    """A DFlash2 drafter holding v1's backbone weights, its own modules as initialised."""
    v2 = make_drafter(**V2, **fields)
    missing, unexpected = v2.load_state_dict(v1.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or k.startswith("candidate_selector.") for k in missing)
    return v2.eval()


def randomise(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if isinstance(m, GroupedConv) or "conv" in name or "candidate_selector" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def test_a_new_dflash2_computes_exactly_dflash():
    v1 = make_drafter().eval()
    v2 = v2_like(v1)
    b = packed_batch([40, 25])
    with torch.no_grad():
        h1 = v1.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], ANCHORS)
        h2 = v2.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], ANCHORS)
        assert torch.equal(h1, h2)
        assert torch.equal(v1.draft_block(b["hidden"][:20], 7), v2.draft_block(b["hidden"][:20], 7))
        logits, hidden = v2.draft_block(b["hidden"][:20], 7, return_hidden=True)
        path, _, _ = v2.selector.walk(logits, hidden, 7)  # successor codebook 0: the unary argmax
    assert torch.equal(path, logits.argmax(-1))


def test_convolutions_never_reach_across_a_block_start_and_are_causal():
    conv = randomise(GroupedConv(16, 3, 4))
    z = torch.randn(3, 5, 16)  # three blocks of five rows
    a, delta = conv.prepare(z)
    z2 = z.clone()
    z2[1, 2] += 5.0  # block 1, row 2
    a2, delta2 = conv.prepare(z2)
    changed = (a2 - a).abs().sum(-1) > 0
    assert changed[1, 2:].all() and not changed[1, :2].any() and not changed[[0, 2]].any()
    out, out2 = conv.finish(z, delta), conv.finish(z2, delta2)
    assert torch.equal(out[[0, 2]], out2[[0, 2]]) and torch.equal(out[1, :2], out2[1, :2])
    # the formula, written out for one row and channel: sum_t (base + delta[group]) * z[i - t]
    i, c, G = 4, 9, 4
    d = conv.kernel_projection(z).unflatten(-1, (2, 3, -1))
    want = sum((conv.base_kernel[0, t, c] + d[1, i, 0, t, c // G]) * z[1, i - t, c] for t in range(3))
    torch.testing.assert_close(a[1, i, c], want)


def test_changing_one_block_leaves_every_other_block_unchanged():
    m = randomise(v2_like(make_drafter()))
    b = packed_batch([40, 25])
    ids = b["input_ids"].clone()
    ids[20] = (ids[20] + 1) % 250  # the anchor token of one block (the only token its block reads)
    with torch.no_grad():
        h = m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], ANCHORS)
        h2 = m.forward_train(b["hidden"], ids, b["cu_seqlens"], ANCHORS)
    moved = (h2 - h).abs().flatten(1).sum(-1) > 0
    assert moved.tolist() == [a == 20 for a in ANCHORS.tolist()]


def test_the_greedy_walk_equals_a_brute_force_walk():
    m = randomise(v2_like(make_drafter()), seed=3)
    sel = m.selector
    g = torch.Generator().manual_seed(0)
    logits, hidden = torch.randn(5, 300, generator=g), torch.randn(5, 64, generator=g)
    path, cand, probs = sel.walk(logits, hidden, 11)
    A, P, Bk = sel.predecessor_codebook, sel.hidden_projection.weight, sel.successor_codebook
    prev, want = 11, []
    for j in range(5):
        top = sorted(range(300), key=lambda v: -float(logits[j, v]))[: sel.top_k]
        proj = [float(P[r] @ hidden[j]) for r in range(P.shape[0])]
        score = {
            c: float(logits[j, c])
            + sum(float(A[prev, r]) * proj[r] * float(Bk[c, r]) for r in range(len(proj)))
            for c in top
        }
        prev = max(top, key=lambda c: score[c])
        want.append(prev)
    assert path.tolist() == want
    assert torch.equal(probs.argmax(-1), (cand == path[:, None]).float().argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(5))
    sampled, _, q = sel.walk(logits, hidden, 11, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert (q > 0).all() and torch.allclose(q.sum(-1), torch.ones(5))
    assert all(int(t) in cand[j].tolist() for j, t in enumerate(sampled))


def test_dpace_weights_by_hand():
    p = torch.tensor([[0.8, 0.5, 0.2, 0.9]])
    valid = torch.tensor([[True, True, False, True]])
    q = [0.9, 0.75, 1.0, 0.95]  # (1 - 0.5) p + 0.5; the invalid offset counts as 1
    prods = [q[0], q[0] * q[1], q[0] * q[1] * q[2], q[0] * q[1] * q[2] * q[3]]
    terms = [prods[0], prods[1], 0.0, prods[3]]  # invalid offsets add no term
    want = [sum(terms[j:]) if v else 0.0 for j, v in enumerate(valid[0].tolist())]
    torch.testing.assert_close(dpace_weights(p, valid)[0], torch.tensor(want))
    # SpecForge's schedule: whole steps (int(ratio x total)), then a ramp one step ahead
    assert alpha_at(0, 100, 1.0, 0.1, 0.2) == 0.0 and alpha_at(9, 100, 1.0, 0.1, 0.2) == 0.0
    assert alpha_at(10, 100, 1.0, 0.1, 0.2) == pytest.approx(0.05)
    assert alpha_at(20, 100, 1.0, 0.1, 0.2) == pytest.approx(0.55)
    assert alpha_at(50, 100, 2.0, 0.1, 0.2) == 2.0 and alpha_at(5, 100, 1.0, 0.0, 0.0) == 1.0
    assert alpha_at(0, 100, 1.0, 0.0, 0.01) == 1.0  # warmup 0, a one-step ramp: full weight at once
    # SpecForge's DFlash2 example (warmup and ramp 0.0005) over 20,000 steps: 10 steps each
    assert [alpha_at(s, 20_000, 1.0, 0.0005, 0.0005) for s in (9, 10, 14, 19, 20)] == [
        0.0,
        0.1,
        0.5,
        1.0,
        1.0,
    ]
    assert alpha_at(3, 100, 0.0, 0.0, 0.5) == 0.0


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_chunked_head_and_top_values_match_full_logits(softcap):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(13, 16, generator=g, requires_grad=True)
    W = torch.randn(40, 16, generator=g)
    y = torch.randint(0, 40, (13,), generator=g)
    w = torch.rand(13, generator=g)
    c = torch.randn(13, 4, generator=g)
    rows = head_rows(h, W, y, chunk=5, multiplier=0.7, softcap=softcap, top_k=4)
    ((w * rows.loss).sum() + (c * top_values(h, W, rows, chunk=6)).sum()).backward()
    mine = h.grad.clone()
    h.grad = None
    raw = (h @ W.t()) * 0.7
    u = softcap * torch.tanh(raw / softcap) if softcap else raw
    ce = torch.nn.functional.cross_entropy(u, y, reduction="none")
    vals, ids = u.topk(4, -1)
    assert torch.equal(ids, rows.top_ids)
    torch.testing.assert_close(rows.loss, ce.detach())
    ((w * ce).sum() + (c * vals).sum()).backward()
    torch.testing.assert_close(mine, h.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("stop_gradient", [False, True])
def test_the_selector_term_trains_what_it_should(stop_gradient):
    m = randomise(v2_like(make_drafter())).train()
    b = packed_batch([40, 25], loss_mask_p=0.9)
    grads, stats = [], []
    for alpha in (0.0, 1.0):
        m.zero_grad()
        loss, st = dflash_loss(
            m,
            b,
            6,
            4.0,
            torch.Generator().manual_seed(0),
            selector_alpha=alpha,
            selector_stop_gradient=stop_gradient,
        )
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        stats.append(st)
    assert grads[0]["candidate_selector.successor_codebook"].abs().sum() == 0
    assert grads[1]["candidate_selector.successor_codebook"].abs().sum() > 0
    same = torch.allclose(
        grads[0]["layers.0.mlp.down_proj.weight"], grads[1]["layers.0.mlp.down_proj.weight"]
    )
    assert same == stop_gradient  # the selector term reaches the backbone unless stopped
    st = stats[1]
    assert torch.equal(st["loss_sum"], stats[0]["loss_sum"]) and float(st["selector_loss_sum"]) > 0
    assert 0 < int(st["covered"].sum()) <= int(st["total"].sum())
    assert int(st["selector_correct"].sum()) <= int(st["covered"].sum())
    assert 0 <= int(st["walk_accepted"]) <= int(st["blocks"]) * 5


def test_checkpoint_names_shapes_and_config(tmp_path):
    m = make_drafter(layers=2, **V2, is_causal=False, output_multiplier=0.5, final_logit_softcapping=30.0)
    m.dcfg.layer_types = ["sliding_attention"] * 2
    m.dcfg.sliding_window = 64
    save_drafter(m, tmp_path / "d")
    H, Inter, nh, nkv, d, K, G, R, Vv = 64, 128, 4, 2, 16, 2, 8, 16, 300
    want = {
        "fc.weight": [H, 3 * H],
        "hidden_norm.weight": [H],
        "norm.weight": [H],
        "candidate_selector.hidden_projection.weight": [R, H],
        "candidate_selector.predecessor_codebook": [Vv, R],
        "candidate_selector.successor_codebook": [Vv, R],
    }
    for i in range(2):
        p = f"layers.{i}."
        want.update(
            {
                p + "input_layernorm.weight": [H],
                p + "post_attention_layernorm.weight": [H],
                p + "self_attn.q_proj.weight": [nh * d, H],
                p + "self_attn.k_proj.weight": [nkv * d, H],
                p + "self_attn.v_proj.weight": [nkv * d, H],
                p + "self_attn.o_proj.weight": [H, nh * d],
                p + "self_attn.q_norm.weight": [d],
                p + "self_attn.k_norm.weight": [d],
                p + "mlp.gate_proj.weight": [Inter, H],
                p + "mlp.up_proj.weight": [Inter, H],
                p + "mlp.down_proj.weight": [H, Inter],
                p + "attention_conv.base_kernel": [2, K, H],
                p + "attention_conv.kernel_projection.weight": [2 * K * H // G, H],
                p + "mlp_conv.base_kernel": [2, K, H],
                p + "mlp_conv.kernel_projection.weight": [2 * K * H // G, H],
            }
        )
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        assert {k: list(f.get_slice(k).get_shape()) for k in f.keys()} == want
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 64
    assert cfg["dflash_config"] == {
        "block_size": 6,
        "mask_token_id": 299,
        "target_layer_ids": [1, 3, 5],
        "conv_kernel_size": 2,
        "conv_group_size": 8,
        "selector_rank": 16,
        "selector_top_k": 5,
        "output_multiplier": 0.5,
        "final_logit_softcapping": 30.0,
    }
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_target_layers", "use_sliding_window"):
        assert key in cfg
    back = load_drafter(tmp_path / "d", m.embed_weight, m.lm_head_weight)
    assert back.dcfg.architecture == "dflash2" and back.dcfg.is_causal is False
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert DraftModelConfig.from_dict(cfg).to_dict() == cfg


def test_logit_transform_reaches_inference_and_training():
    m = make_drafter(output_multiplier=0.5, final_logit_softcapping=2.0).eval()
    b = packed_batch([30])
    with torch.no_grad():
        out = m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], torch.tensor([10]))[0, 1:]
        raw = out @ m.lm_head_weight.t()
        torch.testing.assert_close(m.logits(out), 2.0 * torch.tanh(raw * 0.25))
    assert float(m.draft_block(b["hidden"][:10], 3).abs().max()) <= 2.0


@pytest.mark.skipif(
    not DFLASH2_REF, reason=f"set DFLASH2_REFERENCE_DIR to a checkout of {ZLAB_DFLASH2} (tests/refload.py)"
)
def test_reference_dflash2_loads_our_checkpoint_and_agrees(tmp_path):
    """z-lab's DFlash2DraftModel (``dflash/model.py`` at the commit :data:`refload.ZLAB_DFLASH2`; its
    main has no DFlash2) loads the checkpoint with no missing or unexpected keys, and its block states
    through our frozen head equal ours (nothing is downloaded: the checkout is given)."""
    import torch.nn.functional as F

    why = zlab_lacks(DFLASH2_REF, "dflash2")
    if why:
        pytest.skip(why)
    ref_mod = zlab(DFLASH2_REF)
    ours = randomise(v2_like(make_drafter(block=8), block=8, is_causal=False)).eval()
    save_drafter(ours, tmp_path / "d")
    ref, info = ref_mod.DFlash2DraftModel.from_pretrained(
        tmp_path / "d", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = ref.eval()
    b = packed_batch([37])
    ids = torch.full((1, 8), ours.mask_token_id)
    ids[0, 0] = 77
    with torch.no_grad():
        h = ref(
            position_ids=torch.arange(37 + 8)[None],
            noise_embedding=F.embedding(ids, ours.embed_weight),
            target_hidden=b["hidden"].reshape(1, 37, -1),
        )
        theirs = F.linear(h[0, 1:], ours.lm_head_weight)
        torch.testing.assert_close(ours.draft_block(b["hidden"], 77), theirs, atol=1e-5, rtol=1e-5)


def test_with_selector_alpha_0_the_selector_is_left_out_of_the_optimizer():
    """As SpecForge: no selector term, no selector training (issue 35, item 5)."""
    from dflash_staged.config import TrainConfig
    from dflash_staged.train.trained_drafter import DrafterModel

    m = make_drafter(**V2)
    model = DrafterModel(m, TrainConfig(selector_alpha=0.0), torch.device("cpu"), 0)
    assert model.params and not any("selector" in n for n in model.params)
    m2 = make_drafter(**V2)
    assert any("selector" in n for n in DrafterModel(m2, TrainConfig(), torch.device("cpu"), 0).params)


def test_the_walk_breaks_ties_as_the_reference_and_scores_in_the_logits_dtype():
    """The served walk takes ``topk(sorted=False)`` and scores in the logits' dtype: with every score
    equal the reference's argmax picks the first candidate in that order (issue 35, item 4)."""
    m = make_drafter(**V2).eval()
    sel = m.selector
    logits = torch.zeros(1, 3, 300)
    logits[0, :, 40:45] = 2.0  # five candidates tie at the top of every offset's unary logits
    hidden = torch.randn(1, 3, 64)
    path, cand, q = sel.walk(logits, hidden, torch.tensor([7]))
    unary, order = logits.topk(sel.top_k, dim=-1, sorted=False)
    assert torch.equal(cand, order)  # the reference's candidates, in its order
    # the successor codebook starts at 0: every score is the unary logit, ties at 2.0 everywhere
    first = [int(order[0, j][(unary[0, j] == unary[0, j].max()).nonzero()[0, 0]]) for j in range(3)]
    assert path[0].tolist() == first
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 0.5)
    half = sel.walk(logits.to(torch.bfloat16), hidden.to(torch.bfloat16), torch.tensor([7]))
    sel_f = sel.walk(logits, hidden, torch.tensor([7]))
    assert (
        half[0].shape == sel_f[0].shape
    )  # bf16 logits are scored in bf16 (they may differ: docs/dflash2.md)
