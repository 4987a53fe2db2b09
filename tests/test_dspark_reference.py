"""DSpark against DeepSpec's own code (``deepseek-ai/DeepSpec``; skipped unless ``DSPARK_REFERENCE_DIR``
names a local checkout, see ``tests/refload.py``).

Run against DeepSpec's main, afdfa7c9382a3341a3e6f17756dd816da79f132c (2026-06-30). Files read:
``deepspec/modeling/dspark/{common,loss,markov_head}.py``, ``deepspec/modeling/dspark/qwen3/modeling.py``,
``deepspec/eval/base_evaluator.py``, ``deepspec/eval/dspark/draft_ops.py`` and
``deepspec/utils/sampling.py`` (a checkout lacking one skips, naming it).

Compared: our checkpoint loaded by its ``Qwen3DSparkModel`` with no unexpected key (the target's
embedding and head it copies from the target, as its trainer does); the training forward's logits and
confidences, ``compute_dspark_loss`` and every gradient to float32 rounding (main builds its training
mask for flex attention only: its own ``mask_mod`` is evaluated densely for SDPA here); and decoding
against its evaluation loop (``generate_decoding_sample`` with its DSpark proposal), greedy and at
T = 1 with matched draws, with and without the confidence schedule: the tokens, the acceptance and
verified lengths of every step and every block's confidence logits. The decodes run a drafter fitted
to the (sharpened) tiny target (``tests/planted.py``), and assert that most drafts are accepted."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from dflash_staged.config import TargetConfig, load_config
from dflash_staged.evaluate.speculative import DrafterProposer, speculative_generate
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
from dflash_staged.model.drafters.dspark.objective import dspark_objective
from dflash_staged.model.drafters.family import FamilyBatch
from dflash_staged.model.drafters.weights import load_drafter, save_drafter
from dflash_staged.model.target.tiny import MASK
from dflash_staged.model.target.weights import FinalNorm, load_embed_and_head
from dflash_staged.train.objective import sample_anchors

from planted import acceptance, fit_to_target, planted_target
from refload import DEEPSPEC_MAIN, DSPARK_REF, deepspec, deepspec_lacks, dense_block_mask, legacy_crop

pytestmark = pytest.mark.skipif(
    not DSPARK_REF, reason=f"set DSPARK_REFERENCE_DIR to a checkout of {DEEPSPEC_MAIN}"
)
B = 7
FIT = {"ce_weight": 1.0, "l1_weight": 0.0}  # fitted on the data's CE (the L1 term learns slowly from scratch)
_FITTED: dict = {}  # (kind, prompts, new tokens) -> the fitted drafter's weights, shared by a test's params


@pytest.fixture(autouse=True)
def _checkout():
    if why := deepspec_lacks():
        pytest.skip(why)


def pair(tmp_path, kind="vanilla", target=None, prompts=(), new_tokens=0):
    """Our DSpark drafter for the tiny target and the same checkpoint in DeepSpec's class. With ``target``:
    started from the target's top layers and fitted to its greedy continuations of ``prompts``."""
    cfg = load_config("configs/tiny.toml")
    cfg.drafter.dtype, cfg.drafter.architecture, cfg.drafter.block_size = "float32", "dspark", B
    cfg.drafter.options = {"markov_rank": 16, "markov_head_type": kind}
    tcfg = TargetConfig(model="tiny:qwen3")
    embed, head = load_embed_and_head(tcfg)
    torch.manual_seed(0)
    d = DFlashDrafter(DraftModelConfig.from_config(cfg, 128, 2048, 6, [1, 3], MASK), embed, head)
    if target is not None:
        key = (kind, tuple(tuple(p.tolist()) for p in prompts), new_tokens)
        if key not in _FITTED:
            from dflash_staged.model.drafters.init import init_from_target

            init_from_target(d, tcfg)
            fit_to_target(d, target, prompts, new_tokens, steps=100, lr=5e-3, options=FIT)
            _FITTED[key] = {k: v.clone() for k, v in d.state_dict().items()}
        d.load_state_dict(_FITTED[key])
    else:
        with torch.no_grad():
            d.markov_head.markov_w2.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    save_drafter(d, tmp_path / "ckpt")
    ours = load_drafter(tmp_path / "ckpt", embed, head)
    ds = deepspec()
    ref, info = ds.modeling.Qwen3DSparkModel.from_pretrained(
        tmp_path / "ckpt", dtype=torch.float32, output_loading_info=True
    )
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert set(info["missing_keys"]) == {"embed_tokens.weight", "lm_head.weight"}, info
    ref.initialize_embeddings_and_head(
        embed_tokens=torch.nn.Embedding.from_pretrained(embed), lm_head=_linear(head)
    )
    ref.config._attn_implementation = "sdpa"
    assert (ref.block_size, ref.mask_token_id, list(ref.target_layer_ids)) == (B, MASK, [1, 3])
    return ours, ref.eval(), ds


def _linear(w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return lin


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_forward_loss_and_gradients_equal_deepspec(tmp_path, monkeypatch, kind):
    ours, ref, ds = pair(tmp_path, kind)
    g = torch.Generator().manual_seed(3)
    T, H = 60, 128
    ids = torch.randint(4, 2048, (T,), generator=g)
    mask = torch.ones(T)
    mask[:6] = 0
    mask[[20, 41]] = 0
    taps, last = torch.randn(T, 2, H, generator=g), torch.randn(T, H, generator=g)
    norm = FinalNorm(torch.rand(H, generator=g) + 0.5, 1e-6)
    anchors = sample_anchors(mask, torch.tensor([0, T]), B, 6, torch.Generator().manual_seed(4))
    keep = torch.ones(1, anchors.numel(), dtype=torch.bool)
    monkeypatch.setattr(ds.modeling, "sample_anchor_positions", lambda **kw: (anchors[None], keep))
    monkeypatch.setattr(ds.common, "create_block_mask", dense_block_mask)  # its mask_mod, for SDPA
    monkeypatch.setattr(ds.loss, "dist", types.SimpleNamespace(get_world_size=lambda: 1))
    out = ref(ids[None], taps.reshape(1, T, -1), mask[None], norm(last)[None].detach())
    ref_loss = ds.loss.compute_dspark_loss(
        outputs=out, loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=1.0
    )
    fb = FamilyBatch(
        ours, taps, ids, mask, torch.tensor([0, T]), anchors, last, norm, "sdpa", 0, 0, 64, None, 4.0
    )
    total, rows = dspark_objective(fb)
    mine = total / rows.weight_sum
    # the forward: the corrected logits and the confidences of every row, and which rows count
    h = ours.forward_train(taps, ids, torch.tensor([0, T]), anchors)
    prev = torch.cat(
        [ids[anchors][:, None], ids[(anchors[:, None] + torch.arange(1, B)).clamp(max=T - 1)]], 1
    )
    m, e = ours.markov_head.latents(prev, h)
    logits = h @ ours.lm_head_weight.T + ours.markov_head.bias(m)
    valid = out.eval_mask[0]
    conf = ours.confidence_head(torch.cat([h, e], -1)).reshape(valid.shape)
    ref_conf = out.confidence_pred[0].reshape(valid.shape)
    d_logits = (logits - out.draft_logits[0]).abs()[valid].max()
    d_conf = (conf - ref_conf).abs()[valid].max()
    assert torch.equal(rows.valid, valid)
    torch.testing.assert_close(logits[valid], out.draft_logits[0][valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conf[valid], ref_conf[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine, ref_loss, rtol=1e-5, atol=1e-6)
    mine.backward()
    ref_loss.backward()
    grads = dict(ref.named_parameters())
    worst = 0.0
    for n, p in ours.named_parameters():
        want = grads[n].grad
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6, msg=n)
        worst = max(worst, float((p.grad - want).abs().max()))
    print(
        f"dspark {kind} vs DeepSpec: max |logit diff| {float(d_logits):.2e}, |confidence diff| "
        f"{float(d_conf):.2e}, loss {float(mine):.6f} vs {float(ref_loss):.6f}, max |grad diff| {worst:.2e}"
    )


def reference_decode(ds, ref, target, prompt, max_new, threshold, temperature=0.0):
    """DeepSpec's evaluation loop for one prompt, with its Qwen3 DSpark evaluator's three callbacks."""
    from transformers import DynamicCache

    def init_context(*, initial_output, **_):
        feats = ds.common.extract_context_feature(initial_output.hidden_states, ref.target_layer_ids)
        return types.SimpleNamespace(past_key_values_draft=DynamicCache(), target_hidden_states=feats)

    def propose(*, context, output_ids, position_ids, start, stop_token_ids=None):
        draft_ids = torch.full((1, B), int(ref.mask_token_id), dtype=torch.long)
        draft_ids[:, 0] = output_ids[:, start]
        hidden = ds.ops.forward_dspark_draft_block(
            ref,
            draft_input_ids=draft_ids,
            position_ids=position_ids,
            past_key_values_draft=context.past_key_values_draft,
            target_hidden_states=context.target_hidden_states,
            start=start,
            block_size=B,
        )
        return ds.ops.build_dspark_proposal(
            ref, draft_input_ids=draft_ids, block_hidden=hidden, block_size=B, temperature=temperature,
            confidence_threshold=threshold,
        )  # fmt: skip

    def update(context, verification):
        feats = ds.common.extract_context_feature(
            verification.target_output.hidden_states, ref.target_layer_ids
        )
        context.target_hidden_states = feats[:, : verification.accepted_draft_tokens + 1, :]

    return ds.base.generate_decoding_sample(
        target_model=target.model, input_ids=prompt[None], max_new_tokens=max_new, max_proposal_tokens=B,
        temperature=temperature, stop_token_ids=None, init_context=init_context, propose=propose,
        update=update,
    )  # fmt: skip


class Confidences:
    """Every block's confidence logits as each side computes them: ours in the DSpark walk, DeepSpec's
    in its proposal (``_predict_confidence_logits``), in call order."""

    def __init__(self, monkeypatch, ds):
        import dflash_staged.model.drafters.dspark as family

        self.ours, self.theirs = [], []
        walk, predict = family.markov_walk, ds.ops._predict_confidence_logits

        def ours(*a, **k):
            out = walk(*a, **k)
            self.ours.append(out[2].detach().clone())
            return out

        def theirs(*a, **k):
            out = predict(*a, **k)
            self.theirs.append(out[0].detach().clone())
            return out

        monkeypatch.setattr(family, "markov_walk", ours)
        monkeypatch.setattr(ds.ops, "_predict_confidence_logits", theirs)

    def equal(self, blocks) -> int:
        """Assert the confidences of ``blocks`` (indices of verify steps) equal; clear; return how many."""
        for k in blocks:
            torch.testing.assert_close(self.ours[k], self.theirs[k], rtol=1e-5, atol=1e-5, msg=f"block {k}")
        self.ours.clear()
        self.theirs.clear()
        return len(blocks)


def prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 2048, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize(
    "threshold", [0.0, 0.9]
)  # 0.9: the schedule cuts some of the fitted drafter's blocks
def test_greedy_decoding_equals_deepspecs_step_for_step(tmp_path, monkeypatch, threshold):
    legacy_crop(monkeypatch)
    target = planted_target()
    asked = prompts(8, [12 + 3 * i for i in range(6)])
    ours, ref, ds = pair(tmp_path, "rnn", target, asked, 38)
    confidences = Confidences(monkeypatch, ds)
    steps = differ = blocks = accepted = drafted = cut = 0
    for i, prompt in enumerate(asked):
        max_new = 33 + i
        r = reference_decode(ds, ref, target, prompt, max_new, threshold)
        mine = speculative_generate(
            target, DrafterProposer(ours, confidence_threshold=threshold), prompt, max_new
        )
        theirs = r.output_ids[0, len(prompt) :].tolist()
        assert mine.tokens == theirs[: len(mine.tokens)] and len(mine.tokens) == max_new
        # every step but the last (ours never verifies past max_new_tokens; DeepSpec trims afterwards);
        # the drafts verified wherever ours is not cut short by max_new_tokens (B or more to come)
        assert mine.accepted[:-1] == r.acceptance_lengths[: len(mine.accepted) - 1]
        left = [max_new - 1 - sum(mine.accepted[:k]) for k in range(len(mine.accepted))]
        full = [k for k, n in enumerate(left) if n >= B]
        assert [mine.verified[k] - 1 for k in full] == [r.proposal_lengths[k] for k in full]
        cut += sum(mine.verified[k] - 1 < B for k in full)
        # every block both drafted (each drafts whole blocks, to the last): the same confidence logits
        blocks += confidences.equal(range(min(len(confidences.ours), len(confidences.theirs))))
        assert blocks >= steps + len(mine.accepted) - 1
        steps += len(mine.accepted)
        differ += sum(a != b for a, b in zip(mine.accepted, r.acceptance_lengths))
        a, n = acceptance(mine)
        accepted, drafted = accepted + a, drafted + n
    assert steps >= 24  # (fewer than before: most drafts are accepted, so each step makes more tokens)
    assert accepted > 0.5 * drafted, (accepted, drafted)  # most drafts accepted: long accepted prefixes
    assert (cut > 0) == (threshold > 0), cut  # the confidence schedule shortened blocks (only with one)
    print(
        f"dspark greedy decode vs DeepSpec (threshold {threshold}): {steps} steps, {differ} differ (last), "
        f"{cut} cut short by the schedule; {blocks} blocks' confidences equal; "
        f"drafts accepted {accepted}/{drafted}"
    )


def test_logits_of_a_block_equal_deepspecs_cached_block(tmp_path, monkeypatch):
    legacy_crop(monkeypatch)
    ours, ref, ds = pair(tmp_path, "gated")
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(5)
    ctx = torch.randn(1, 19, 2 * 128, generator=g)
    draft_ids = torch.full((1, B), MASK, dtype=torch.long)
    draft_ids[0, 0] = 77
    with torch.no_grad():
        hidden = ds.ops.forward_dspark_draft_block(
            ref, draft_input_ids=draft_ids, position_ids=torch.arange(40)[None],
            past_key_values_draft=DynamicCache(), target_hidden_states=ctx, start=19, block_size=B,
        )  # fmt: skip
        logits, h = ours.draft_block(ctx[0].reshape(19, 2, 128), 77, return_hidden=True)
    torch.testing.assert_close(h, hidden[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, F.linear(hidden[0], ref.lm_head.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threshold", [0.0, 0.95])  # 0.95: the schedule cuts some of its blocks
def test_sampled_decoding_equals_deepspecs_with_matched_draws(tmp_path, monkeypatch, threshold):
    """At T = 1 both sides draw the same uniforms (tests/matched.py): the first token, each row's draft
    through the Markov head, each verify's uniforms and its last token. Every step whose block ours
    verifies whole (B or more tokens to come) equals DeepSpec's: tokens, acceptance and verified
    lengths, and the block's confidence logits."""
    from matched import matched_draws

    from dflash_staged.evaluate.sampling import Sampler, SamplingSettings

    legacy_crop(monkeypatch)
    target = planted_target()
    asked = prompts(9, [10 + 4 * i for i in range(6)])
    ours, ref, ds = pair(tmp_path, "vanilla", target, asked, 40)
    confidences = Confidences(monkeypatch, ds)
    sampler = Sampler(SamplingSettings(temperature=1.0))
    steps = accepted = drafted = cut = 0
    for i, prompt in enumerate(asked):
        max_new = 40
        with matched_draws(200 + i, monkeypatch):
            mine = speculative_generate(
                target,
                DrafterProposer(ours, confidence_threshold=threshold),
                prompt,
                max_new,
                sampler=sampler,
            )
        with matched_draws(200 + i, monkeypatch):
            r = reference_decode(ds, ref, target, prompt, max_new, threshold, temperature=1.0)
        left = [max_new - 1 - sum(mine.accepted[:k]) for k in range(len(mine.accepted))]
        full = [k for k, n in enumerate(left) if n > B]  # ours shortens the last blocks; draws part there
        n_tok = 1 + sum(mine.accepted[k] for k in full)
        assert mine.tokens[:n_tok] == r.output_ids[0, len(prompt) : len(prompt) + n_tok].tolist()
        assert [mine.accepted[k] for k in full] == r.acceptance_lengths[: len(full)]
        assert [mine.verified[k] - 1 for k in full] == r.proposal_lengths[: len(full)]
        cut += sum(mine.verified[k] - 1 < B for k in full)
        confidences.equal(full)
        steps += len(full)
        a, n = acceptance(mine, full)
        accepted, drafted = accepted + a, drafted + n
    assert steps >= 24  # (fewer than before: most drafts are accepted, so each step makes more tokens)
    assert drafted > accepted > 0.5 * drafted, (accepted, drafted)  # mostly accepted, some rejected
    assert (cut > 0) == (threshold > 0), cut
    print(
        f"dspark T=1 (threshold {threshold}) vs DeepSpec with matched draws: {steps} steps equal, {cut} cut "
        f"short by the schedule, confidences equal; drafts accepted {accepted}/{drafted}"
    )
