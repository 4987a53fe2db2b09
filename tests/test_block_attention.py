"""The DFlash attention rule (full and sliding layers) and the paths that evaluate it: brute-force
references, the block-sparse flex path against the SDPA path (outputs and gradients), cut keys."""

import dataclasses

import pytest
import torch

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters import flex as flex_blocks
from dflash_staged.model.drafters.attention import Packing, SdpaBlocks, block_visible, context_visible
from dflash_staged.model.drafters.backbone import DFlashDrafter
from dflash_staged.model.drafters.flex import FlexBlocks, bucket, resolve_attention
from dflash_staged.train.objective import dflash_loss

from helpers import make_drafter, packed_batch

LENGTHS = [23, 9, 31]
ANCHORS = torch.tensor([40, 0, 23, 5, 31, 32, 62, 1, 22, 60, 50, 17])  # unsorted; starts, ends, past the end


def with_layers(m, layer_types, window, is_causal=None):
    """The same weights with other layer kinds."""
    out = DFlashDrafter(
        dataclasses.replace(m.dcfg, layer_types=layer_types, sliding_window=window, is_causal=is_causal),
        m.embed_weight,
        m.lm_head_weight,
    )
    out.load_state_dict(m.state_dict())
    return out.eval()


def sees_context(p, a, q, w):  # the rule, as the docs state it
    return p < a and (w == 0 or p > a + q - w)


def sees_block(k, q, w, causal=None):
    """The reference's rule: causal per is_causal (default: sliding layers), and a sliding layer's
    query and key within the window of each other."""
    causal = w > 0 if causal is None else causal
    return (k <= q or not causal) and (w == 0 or abs(q - k) < w)


@pytest.mark.parametrize("causal", [None, True, False])
@pytest.mark.parametrize("w", [0, 1, 3, 7])
def test_rule_against_brute_force(w, causal):
    B, L = 5, 14
    p = torch.arange(L)[None, None, :]
    a = torch.arange(L)[:, None, None]
    q = torch.arange(B)[None, :, None]
    got = context_visible(p, a, q, w)
    want = torch.tensor(
        [[[sees_context(pp, aa, qq, w) for pp in range(L)] for qq in range(B)] for aa in range(L)]
    )
    assert torch.equal(got.expand_as(want), want)
    got_b = block_visible(torch.arange(B)[None], torch.arange(B)[:, None], w, causal)
    want_b = torch.tensor([[sees_block(k, qq, w, causal) for k in range(B)] for qq in range(B)])
    assert torch.equal(got_b, want_b)


@pytest.mark.parametrize("w,causal", [(0, False), (4, True), (0, True), (4, False), (2, False)])
def test_flex_mask_against_brute_force(w, causal):
    from torch.nn.attention.flex_attention import create_mask

    B = 4
    cu = torch.tensor([0, 7, 10, 18])
    anchors = torch.tensor([12, 0, 6, 9, 3, 17])
    pk = Packing.of(cu, anchors, B, 18)
    fb = FlexBlocks(pk, {(w, causal)})
    dense = create_mask(fb._mask_mod((w, causal)), 1, 1, fb.Q, fb.KV, device="cpu")[0, 0]
    seq = torch.searchsorted(cu, torch.arange(18), right=True) - 1
    srt = anchors.sort().values.tolist()
    want = torch.zeros(fb.Q, fb.KV, dtype=torch.bool)
    for i, a in enumerate(srt):
        for q in range(B):
            for t in range(18):  # context keys: packed tokens
                if seq[t] == seq[a]:
                    want[i * B + q, t] = sees_context(t - cu[seq[t]], a - cu[seq[a]], q, w)
            for k in range(B):
                want[i * B + q, fb.T_pad + i * B + k] = sees_block(k, q, w, causal)
    assert torch.equal(dense, want)
    assert fb.T_pad == bucket(18) == 128 and fb.Q % B == 0


def brute_force_logits(m, hidden, ids, a):
    """One anchor at position ``a`` of one sequence, every attention by explicit loops over the keys
    the rule lets through."""
    B = m.block_size
    ctx = m.fuse_context(hidden)
    L = ctx.shape[0]
    x = m._block_input(ids[a : a + 1])[0]
    cos_c, sin_c = m._rope(torch.arange(L), x.dtype)
    cos_b, sin_b = m._rope(torch.arange(a, a + B), x.dtype)
    for layer in m.layers:
        at = layer.self_attn
        h = layer.input_layernorm(x)
        kc, vc = at.kv(ctx, cos_c, sin_c)
        kb, vb = at.kv(h, cos_b, sin_b)
        q = at.q(h, cos_b, sin_b)
        g = at.nh // at.nkv
        out = torch.zeros(B, at.nh, at.hd)
        for qo in range(B):
            keys = [(kc[p], vc[p]) for p in range(L) if sees_context(p, a, qo, at.window)]
            keys += [(kb[k], vb[k]) for k in range(B) if sees_block(k, qo, at.window, at.causal)]
            K, V = torch.stack([k for k, _ in keys]), torch.stack([v for _, v in keys])
            for hh in range(at.nh):
                out[qo, hh] = torch.softmax(K[:, hh // g] @ q[qo, hh] / at.hd**0.5, 0) @ V[:, hh // g]
        x = x + at.o_proj(out.flatten(-2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return m.logits(m.norm(x)[1:])


@pytest.mark.parametrize(
    "layer_types,window,is_causal",
    [
        (None, None, None),
        (["sliding_attention", "full_attention"], 5, None),
        (["sliding_attention", "sliding_attention"], 2, None),
        (["sliding_attention", "full_attention"], 3, False),  # the released DFlash2 drafters' setting
        (["sliding_attention", "full_attention"], 3, True),
    ],
)
def test_every_path_against_brute_force(layer_types, window, is_causal):
    m = make_drafter(block=4)
    m = with_layers(m, layer_types, window, is_causal) if layer_types else m.eval()
    b = packed_batch(LENGTHS)
    cu = b["cu_seqlens"].tolist()
    with torch.no_grad():
        sdpa = m.logits(m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], ANCHORS)[:, 1:])
        flex = m.logits(m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], ANCHORS, "flex")[:, 1:])
        for i, t in enumerate(ANCHORS.tolist()):
            s = max(c for c in cu[:-1] if c <= t)
            e = min(c for c in cu[1:] if c > t)
            ref = brute_force_logits(m, b["hidden"][s:e], b["input_ids"][s:e], t - s)
            torch.testing.assert_close(sdpa[i], ref, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(flex[i], ref, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(
                m.draft_block(b["hidden"][s:t], b["input_ids"][t]), ref, atol=2e-5, rtol=1e-5
            )


def hop_kernel(q, k, v, block_mask):
    """flex_attention's own math (its higher-order op, run eagerly) with autograd: the public
    function refuses backward on CPU, so this is how a CPU test reaches flex's gradients."""
    from torch._higher_order_ops.flex_attention import flex_attention as hop
    from torch.nn.attention.flex_attention import _apply_kernel_options, _identity

    opts = _apply_kernel_options(q, k, v, False, None, None)
    return hop(q, k, v, _identity, block_mask.as_tuple(), q.shape[-1] ** -0.5, opts)[0]


@pytest.mark.parametrize("heads,kv", [(4, 2), (4, 1)])
def test_flex_path_equals_sdpa_path_outputs_and_gradients(monkeypatch, heads, kv):
    monkeypatch.setattr(flex_blocks, "_kernel", hop_kernel)
    base = with_layers(make_drafter(heads=heads, kv=kv), ["sliding_attention", "full_attention"], 6).train()
    b = packed_batch([37, 12, 29], loss_mask_p=0.8, seed=3)
    results = {}
    for attention in ("sdpa", "flex"):
        m = with_layers(base, base.dcfg.layer_types, 6).train()
        loss, stats = dflash_loss(
            m, b, num_anchors=9, gamma=4.0, generator=torch.Generator().manual_seed(5), attention=attention
        )
        loss.backward()
        results[attention] = (loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}, stats)
    (l1, g1, s1), (l2, g2, s2) = results["sdpa"], results["flex"]
    torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-6)
    assert g1.keys() == g2.keys()
    for n in g1:
        assert g1[n].abs().sum() > 0, n
        torch.testing.assert_close(g1[n], g2[n], atol=1e-6, rtol=1e-4, msg=n)
    assert torch.equal(s1["correct"], s2["correct"]) and torch.equal(s1["accepted"], s2["accepted"])


def test_cut_keys_change_nothing_but_the_work():
    m = with_layers(make_drafter(), ["sliding_attention", "full_attention"], 4)
    b = packed_batch([60, 45])
    anchors = torch.tensor([3, 10, 20, 30, 50, 61, 70, 80, 100])
    made = {}

    def variant(cut):
        def build(pk, kinds):
            made[cut] = SdpaBlocks(pk, m.dcfg.num_attention_heads, kinds, cut_keys=cut)
            return made[cut]

        return build

    with torch.no_grad():
        full = m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], anchors, variant(False))
        cut = m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], anchors, variant(True))
    torch.testing.assert_close(full, cut, atol=1e-6, rtol=1e-6)
    assert made[True].computed < made[False].computed


def test_attention_choice_is_resolved_per_device():
    cpu = torch.device("cpu")
    assert resolve_attention("auto", cpu) == "sdpa" and resolve_attention("sdpa", cpu) == "sdpa"
    with pytest.raises(
        DflashError, match=r"train.attention='flex' on cpu: .*no backward.*train.attention = \"sdpa\""
    ):
        resolve_attention("flex", cpu)
    with pytest.raises(DflashError, match="use one of auto, flex, sdpa"):
        resolve_attention("dense", cpu)
    assert [bucket(n) for n in (1, 128, 129, 1000, 4096)] == [128, 128, 256, 1024, 4096]


@pytest.mark.slow
def test_compiled_flex_forward_on_cpu_equals_sdpa():  # ~30 s: inductor compiles the CPU template
    m = with_layers(make_drafter(), ["sliding_attention", "full_attention"], 6)
    b = packed_batch(LENGTHS)

    def compiled(q, k, v, block_mask):
        from torch.nn.attention.flex_attention import flex_attention

        return torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=block_mask, enable_gqa=True)

    with torch.no_grad():
        ref = m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], ANCHORS)
        flex_blocks._kernel, saved = compiled, flex_blocks._kernel
        try:
            got = m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], ANCHORS, "flex")
        finally:
            flex_blocks._kernel = saved
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_compiled_flex_on_cuda_equals_sdpa_outputs_and_gradients():
    """The real training path: compiled flex_attention (Triton) against SDPA, fp32, GQA, a sliding layer."""
    base = with_layers(make_drafter(heads=4, kv=2), ["sliding_attention", "full_attention"], 6)
    b = {k: v.cuda() for k, v in packed_batch([300, 57, 140], loss_mask_p=0.8, seed=3).items()}
    assert resolve_attention("auto", torch.device("cuda")) == "flex"
    results = {}
    for attention in ("sdpa", "flex"):
        m = with_layers(base, base.dcfg.layer_types, 6).cuda().train()
        loss, _ = dflash_loss(
            m,
            b,
            num_anchors=40,
            gamma=4.0,
            generator=torch.Generator("cuda").manual_seed(5),
            attention=attention,
        )
        loss.backward()
        results[attention] = (loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()})
    (l1, g1), (l2, g2) = results["sdpa"], results["flex"]
    torch.testing.assert_close(l1, l2, atol=1e-4, rtol=1e-4)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], atol=1e-4, rtol=1e-3, msg=n)


@pytest.mark.parametrize("B", [2, 3, 10, 16, 32])
def test_flex_shapes_per_layer_kind_stay_under_the_recompile_limit(B):
    """Every (context, anchors) up to MAX_CONTEXT tokens, one anchor per token at most, lands in at
    most shape_bound shapes per layer kind, and two kinds of the recipe block fit Dynamo's limit."""
    edges = sorted({max(1, (1 << k) + d) for k in range(18) for d in (-1, 0, 1)} | {3, 5, 77, 1000, 99_999})
    contexts = [T for T in edges if T <= flex_blocks.MAX_CONTEXT]
    shapes = {flex_blocks.padded_shape(T, A, B) for T in contexts for A in edges if A <= T}
    assert len(shapes) <= flex_blocks.shape_bound(flex_blocks.MAX_CONTEXT, B)
    assert len(shapes) >= flex_blocks.shape_bound(flex_blocks.MAX_CONTEXT, B) - 11  # the bound is tight
    assert 2 * flex_blocks.shape_bound(flex_blocks.MAX_CONTEXT, 16) <= flex_blocks.RECOMPILE_LIMIT
    for T_pad, A_pad in shapes:  # padding: at most 2x the context, 2x the rows or T_pad/16 rows
        assert T_pad >= 128 and T_pad & (T_pad - 1) == 0 and A_pad * B >= T_pad >> flex_blocks.QUERY_SPAN
    T_pad, A_pad = flex_blocks.padded_shape(16384, 5 * 512, 16)
    assert (T_pad, A_pad * 16) == (16384, 65536)
    assert flex_blocks.padded_shape(40_000, 3, 16) == (65536, 4096 // 16)  # few anchors, long context


def test_each_new_flex_shape_is_logged_once_and_the_recompile_limits_follow(monkeypatch, capsys):
    import torch._dynamo

    cfg = torch._dynamo.config
    monkeypatch.setattr(flex_blocks, "_shapes", set())
    monkeypatch.setattr(cfg, "recompile_limit", 8)
    monkeypatch.setattr(cfg, "accumulated_recompile_limit", 256)
    full, sliding = (0, False), (4096, True)
    assert flex_blocks.note_shape(16384, 8192, 16, full) and not flex_blocks.note_shape(16384, 8192, 16, full)
    assert flex_blocks.note_shape(16384, 8192, 16, sliding)  # another layer kind: another compile
    err = capsys.readouterr().err
    assert err.count("flex_attention: compiling shape") == 2 and "window full" in err and "window 4096" in err
    assert cfg.recompile_limit == cfg.accumulated_recompile_limit == flex_blocks.RECOMPILE_LIMIT
    for i in range(200):  # past the static limit, the limits keep above twice the shapes seen
        flex_blocks.note_shape(128, 128 * (i + 2), 16, full)
    capsys.readouterr()
    assert cfg.recompile_limit >= 2 * len(flex_blocks._shapes) and cfg.accumulated_recompile_limit >= 404
