"""DSpine against SpecForge's own code (``sgl-project/SpecForge``; skipped unless ``DSPINE_REFERENCE_DIR``
names a local checkout, see ``tests/refload.py``).

Files read: ``specforge/modeling/draft/dspine.py`` (``DSpineDraftModel``) and
``specforge/algorithms/dspine/model.py`` (``OnlineDSpineModel``). SpecForge's main has none yet (the
newest snapshot here, a6b6b0230009d15ec2a97a57384e6f53f0f96946 of 2026-08-08, has no DSpine): the tests
ran against those two files as of SpecForge 9aafadfceaeb728209d4b4c6bda221f2c1fed70f (``dspine.py``) and
f7bed051d09b605f37f494dfd3640b0487b2536e (``model.py``), and skip, naming the files, on a checkout that
lacks them.

They run as they are, over DFlash base classes given here: the draft base holds *our* backbone's
layers (the DFlash backbone is held to z-lab's reference in ``tests/test_drafter_reference.py``) behind
SpecForge's layer call, and the training base supplies the DFlash layout (anchors, positions, the
block's input) and the block-causal mask by our attention rule. So what is compared is everything DSpine
adds: our checkpoint loads into its module tree with no missing or unexpected key; the transfer space;
the schedule; the training forward's states, the objective and every gradient; and the decoding (its
transition scores and ``select_cached``) block by block and over whole greedy decodes, step for step,
with a drafter fitted to the (sharpened) tiny target (``tests/planted.py``) whose drafts are mostly
accepted."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_staged.config import TargetConfig
from dflash_staged.evaluate.speculative import DrafterProposer, speculative_generate
from dflash_staged.model.drafters.attention import block_visible, context_visible, sdpa
from dflash_staged.model.drafters.dspine.objective import dspine_objective, schedule
from dflash_staged.model.drafters.family import FamilyBatch
from dflash_staged.model.target.weights import FinalNorm, load_embed_and_head

from helpers import make_drafter
from planted import acceptance, fit_to_target, planted_target
from refload import DSPINE_REF, SPECFORGE_DSPINE, specforge, specforge_lacks

pytestmark = pytest.mark.skipif(
    not DSPINE_REF,
    reason="set DSPINE_REFERENCE_DIR to a SpecForge checkout with "
    + ", ".join(f"{f} (as of {c[:12]})" for f, c in SPECFORGE_DSPINE.items()),
)
B, OPTS = 6, {"transfer_rank": 32, "message_size": 16, "top_k": 8, "replacement_layers": 2}
EMBED, HEAD = load_embed_and_head(TargetConfig(model="tiny:qwen3"))
MASK = 3


@pytest.fixture(autouse=True)
def _checkout():
    if why := specforge_lacks():
        pytest.skip(why)


def ours(seed=0, live=True):
    torch.manual_seed(seed)
    d = make_drafter(architecture="dspine", layers=3, block=B, k_taps=2, hidden=128, vocab=2048, options=OPTS)
    d.embed_weight, d.lm_head_weight = EMBED, HEAD
    d.mask_token_id = MASK
    d.family.reset_parameters(d)  # the transfer space of the tiny target's head
    if live:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in [
                *d.injection.writes.parameters(),
                d.injection.predecessor_gate.weight,
                d.injection.bias,
            ]:
                p.normal_(0, 0.3, generator=g)
    return d


def mask_builder(
    anchor_positions, block_keep_mask, S, block_size, device, causal_block=False, sliding_window=None
):
    """A dense [1, 1, Q, S + Q] mask by our attention rule (SpecForge's create_dflash_sdpa_mask's role)."""
    N = anchor_positions.shape[1]
    q = torch.arange(N * block_size)
    blk, off = q // block_size, q % block_size
    a = anchor_positions[0][blk][:, None]
    ctx = context_visible(torch.arange(S)[None], a, off[:, None], sliding_window or 0)
    kv = torch.arange(N * block_size)
    same = blk[:, None] == (kv // block_size)[None]
    inner = block_visible((kv % block_size)[None], off[:, None], sliding_window or 0, causal_block)
    keep = block_keep_mask[0][blk][:, None]
    return (torch.cat([ctx, same & inner], 1) & keep)[None, None]


def draft_base(backbone):
    """SpecForge's DFlashDraftModel's role: our backbone's modules, SpecForge's call convention."""

    class DFlashBase(nn.Module):
        def __init__(self, config, **_):
            super().__init__()
            self.config, self.block_size = config, config.block_size
            self.layers, self.fc, self.hidden_norm, self.norm = (
                backbone.layers, backbone.fc, backbone.hidden_norm, backbone.norm
            )  # fmt: skip
            self.layer_types, self.sliding_window = ["full_attention"] * len(self.layers), None
            self.rotary_emb = lambda hidden, pos: backbone._rope(pos, hidden.dtype)
            for layer in self.layers:
                layer.forward = _specforge_call(layer)

    return DFlashBase


def _specforge_call(layer):
    run = type(layer).forward.__get__(layer)

    def forward(hidden_states, target_hidden, attention_mask, position_ids, position_embeddings, **_):
        cos, sin = position_embeddings
        S = target_hidden.shape[1]

        def attend(attn, h):
            k_c, v_c = attn.kv(target_hidden[0], cos[0, :S], sin[0, :S])
            k_b, v_b = attn.kv(h[0], cos[0, S:], sin[0, S:])
            q = attn.q(h[0], cos[0, S:], sin[0, S:]).transpose(0, 1)
            k, v = torch.cat([k_c, k_b]).transpose(0, 1), torch.cat([v_c, v_b]).transpose(0, 1)
            return sdpa(q, k, v, attention_mask[0, 0]).transpose(0, 1).flatten(-2)[None]

        return run(hidden_states, attend)

    return forward


class OnlineBase(nn.Module):
    """SpecForge's OnlineDFlashModel's role: the DFlash layout for the anchors the test fixes."""

    def _sample_anchor_positions(self, length, loss_mask, device, max_valid):
        return self.anchors[None], torch.ones(1, self.anchors.numel(), dtype=torch.bool)

    def _create_position_ids(self, anchors):
        return (anchors[..., None] + torch.arange(self.block_size)).flatten(1)

    def _create_noise_embed(self, input_ids, anchors, keep):
        ids = torch.full((anchors.shape[1], self.block_size), MASK)
        ids[:, 0] = input_ids[0, anchors[0]]
        return F.embedding(ids.reshape(1, -1), EMBED)


def reference(d):
    """SpecForge's DSpine draft model over ``d``'s backbone, with ``d``'s weights loaded (strictly)."""
    backbone = make_drafter(layers=3, block=B, k_taps=2, hidden=128, vocab=2048, is_causal=True)
    sf = specforge(draft_base(backbone), OnlineBase, mask_builder)
    cfg = types.SimpleNamespace(hidden_size=128, vocab_size=2048, num_hidden_layers=3, block_size=B)
    cfg.dspine_config = dict(d.dcfg.options)
    ref = sf.draft.DSpineDraftModel(cfg)
    missing, unexpected = ref.load_state_dict(d.state_dict(), strict=True)
    assert not missing and not unexpected
    return ref, sf


def test_transfer_space_and_schedule_equal_specforges():
    d = ours(live=False)
    ref, sf = reference(d)
    fresh = sf.draft.DSpineDraftModel(ref.config)
    fresh.initialize_transfer_space(HEAD)
    torch.testing.assert_close(d.transfer_codes, fresh.transfer_codes, atol=1e-5, rtol=1e-5)
    for a, b in zip(d.injection.readouts, fresh.injection.readouts):
        torch.testing.assert_close(a.weight, b.weight, atol=1e-5, rtol=1e-5)
    cfg = sf.draft.DSpineConfig(**d.dcfg.options)
    for step, total in [(0, 100), (30, 100), (200, 600), (150, 600), (599, 600), (7, 0)]:
        assert schedule(d.dcfg.options, step, total) == pytest.approx(cfg.schedule(step, total))


@pytest.mark.parametrize("step", [10, 500])
def test_training_forward_objective_and_gradients_equal_specforges(step):
    d = ours(seed=2)
    ref, sf = reference(d)
    g = torch.Generator().manual_seed(4)
    T = 64
    ids = torch.randint(4, 2048, (T,), generator=g)
    mask = torch.ones(T)
    mask[:5] = 0
    mask[[22, 40]] = 0
    taps, last = torch.randn(T, 2, 128, generator=g), torch.randn(T, 128, generator=g)
    norm = FinalNorm(torch.rand(128, generator=g) + 0.5, 1e-6)
    anchors = torch.tensor([5, 9, 17, 23, 30, 44, 58, 61])
    om = sf.model.OnlineDSpineModel.__new__(sf.model.OnlineDSpineModel)
    nn.Module.__init__(om)
    om.draft_model, om.lm_head = ref, nn.Linear(128, 2048, bias=False)
    om.lm_head.weight.data.copy_(HEAD)
    om.lm_head.requires_grad_(False)
    om.anchors, om.block_size, om.loss_decay_gamma = anchors, B, 7.0
    om.dspine_config, om.attention_backend, om.objective_chunk_blocks = ref.dspine_config, "sdpa", 0
    om.causal_block = True  # (f7bed05 reads it for sliding layers; these are all full)
    om.train()
    torch.manual_seed(9)  # its block replacement draws from the global generator
    theirs, _, metrics = om(
        ids[None], taps.reshape(1, T, -1), mask[None], norm(last)[None].detach(), None, step, 600
    )
    fb = FamilyBatch(
        d, taps, ids, mask, torch.tensor([0, T]), anchors, last, norm, "sdpa", step, 600, 16,
        torch.Generator().manual_seed(9), 7.0,
    )  # fmt: skip
    total, rows = dspine_objective(fb)
    mine = total / rows.weight_sum
    torch.testing.assert_close(rows.weight_sum, metrics["loss_terms"][1])
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    mine.backward()
    theirs.backward()
    worst, grads = 0.0, dict(ref.named_parameters())
    for n, p in d.named_parameters():
        if p.grad is None:
            assert grads[n].grad is None or not grads[n].grad.any(), n
            continue
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-4, atol=1e-6, msg=n)
        worst = max(worst, float((p.grad - grads[n].grad).abs().max()))
    print(
        f"dspine step {step} vs SpecForge: loss {float(mine):.6f} vs {float(theirs):.6f}, "
        f"max |grad diff| {worst:.2e}"
    )


def reference_block(ref, context, anchor):
    """SpecForge's decode of one block: its forward (no cache, the block-causal mask), the top-k of the
    proposal rows' logits, ``transition_scores`` over the last layer's states and ``select_cached``."""
    S = context.shape[0]
    tokens = torch.full((1, 1, B), MASK)
    tokens[0, 0, 0] = anchor
    out = ref(
        position_ids=torch.arange(S + B)[None],
        attention_mask=mask_builder(
            torch.tensor([[S]]), torch.ones(1, 1, dtype=torch.bool), S, B, "cpu", True
        ),
        noise_embedding=F.embedding(tokens.reshape(1, -1), EMBED),
        target_hidden=context.reshape(1, S, -1),
        block_token_ids=tokens,
    )
    cand = F.linear(out.hidden_states[0, 0, 1:], HEAD).topk(OPTS["top_k"], -1).indices
    scores = ref.transition_scores(out.pre_injection[0, 0, 1:], cand, torch.tensor(anchor), HEAD)
    return ref.select_cached(scores, cand)


class ReferenceProposer:
    block_size, sized = B, False

    def __init__(self, ref):
        self.ref = ref

    def reset(self):
        pass

    @torch.no_grad()
    def propose(self, context, tokens, sampler=None):
        return reference_block(self.ref, context, int(tokens[context.shape[0]]))


def test_decoding_equals_specforges_block_by_block_and_step_for_step():
    from dflash_staged.model.drafters.init import init_from_target

    target = planted_target()
    g = torch.Generator().manual_seed(6)
    blocks = [
        (torch.randn(17, 2, 128, generator=g), int(torch.randint(4, 2048, (), generator=g))) for _ in range(5)
    ]
    asked = [torch.randint(4, 2048, (10 + 4 * i,), generator=g) for i in range(5)]
    d = ours(seed=5)
    init_from_target(d, TargetConfig(model="tiny:qwen3"))
    # fitted to the target's continuations of the prompts decoded (on the CE: the L1 learns slowly)
    fit_to_target(d, target, asked, 30, steps=100, lr=3e-3, options={"ce_weight": 1.0})
    ref, _ = reference(d)
    ref.eval()
    with torch.no_grad():
        for ctx, anchor in blocks:
            assert (
                DrafterProposer(d).propose(ctx, torch.full((18,), anchor)).tolist()
                == reference_block(ref, ctx, anchor).tolist()
            )
    steps = accepted = drafted = 0
    for prompt in asked:
        mine = speculative_generate(target, DrafterProposer(d), prompt, 30)
        theirs = speculative_generate(target, ReferenceProposer(ref), prompt, 30)
        assert mine == theirs
        steps += len(mine.accepted)
        a, n = acceptance(mine)
        accepted, drafted = accepted + a, drafted + n
    assert accepted > 0.5 * drafted, (accepted, drafted)  # most drafts accepted: long accepted prefixes
    print(
        f"dspine greedy decode vs SpecForge's transition scores: {steps} steps, all equal; "
        f"drafts accepted {accepted}/{drafted}"
    )
