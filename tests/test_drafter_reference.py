"""Cross-check against z-lab's reference implementation (``z-lab/dflash``, its ``dflash/model.py``).

Skipped unless ``DFLASH_REFERENCE_DIR`` names a local checkout (nothing is downloaded at test time; see
``tests/refload.py``). Which commit each comparison needs:

* z-lab's main, 44947fbf71114e241c96de194f4b382b5dd330d0 (2026-04-26), has DFlash only. Against it:
  our checkpoint loads into its ``DFlashDraftModel`` (plain and sliding-window) and agrees block for
  block, and greedy ``speculative_generate`` equals its ``dflash_generate`` with a bidirectional
  drafter (every token; every step's drafts and acceptance length where both verify a whole block:
  main never shortens its last blocks, ours does).
* The rest needs ``dflash/model.py`` at 07ebd93db9f472af339b644bb70221ad8428328a (the DFlash2 era):
  ``DFlash2DraftModel``, the draft masks of ``is_causal`` and sliding-window layers
  (``_attention_mask``), rejection-sampled decoding with top-p / top-k (``_rejection_sample``) and the
  shortened last blocks. Point ``DFLASH2_REFERENCE_DIR`` at such a checkout (by default
  ``DFLASH_REFERENCE_DIR`` is used for these too): a comparison whose file lacks what it needs skips,
  naming it. With both set, the main comparisons run against both checkouts.

The decodes run a drafter fitted to the (sharpened) tiny target (``tests/planted.py``) and assert that
most drafts are accepted.
"""

import inspect
import os
import time

import pytest
import torch
import torch.nn.functional as F

from dflash_staged.config import TargetConfig, load_config
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
from dflash_staged.model.drafters.weights import save_drafter
from dflash_staged.model.target.tiny import MASK
from dflash_staged.model.target.weights import load_embed_and_head

from planted import acceptance, fit_to_target, planted_target
from refload import DFLASH2_REF, DFLASH_REF, ZLAB_DFLASH2, ZLAB_MAIN, legacy_crop, zlab, zlab_lacks

pytestmark = pytest.mark.skipif(
    not DFLASH_REF,
    reason=f"set DFLASH_REFERENCE_DIR to a checkout of {ZLAB_MAIN} (and DFLASH2_REFERENCE_DIR to one of "
    f"{ZLAB_DFLASH2} for DFlash2, the causal and sliding-window masks and sampled decoding)",
)
_PINNED = os.environ.get("DFLASH2_REFERENCE_DIR", "")
CHECKOUTS = {  # each checkout given, by its variable (the second only when it names another)
    "DFLASH_REFERENCE_DIR": DFLASH_REF,
    "DFLASH2_REFERENCE_DIR": _PINNED if _PINNED != DFLASH_REF else "",
}
_FITTED: dict = {}  # setup -> the fitted drafter's weights, shared by the decode tests


@pytest.fixture(params=list(CHECKOUTS))
def checkout(request):
    """Each checkout given (``DFLASH_REFERENCE_DIR``, and ``DFLASH2_REFERENCE_DIR`` when it is another)."""
    if not CHECKOUTS[request.param]:
        pytest.skip("DFLASH2_REFERENCE_DIR is not set (or is DFLASH_REFERENCE_DIR)")
    if why := zlab_lacks(CHECKOUTS[request.param]):
        pytest.skip(why)
    return CHECKOUTS[request.param]


def reference_module(*features, ref=None):
    """z-lab's ``dflash/model.py`` for a comparison needing ``features`` (see ``refload.ZLAB_FEATURES``):
    ``ref``'s, else the first of ``DFLASH_REFERENCE_DIR``, ``DFLASH2_REFERENCE_DIR`` that has them; skips
    naming what is missing."""
    for r in [ref] if ref else dict.fromkeys([DFLASH_REF, DFLASH2_REF]):
        if zlab_lacks(r, *features) is None:
            return zlab(r)
    pytest.skip(zlab_lacks(ref or DFLASH2_REF, *features))


def test_reference_model_loads_our_checkpoint_and_agrees(tmp_path, checkout):
    ref_mod = reference_module(ref=checkout)
    cfg = load_config("configs/tiny.toml")
    cfg.drafter.dtype = "float32"
    embed, head = load_embed_and_head(TargetConfig(model="tiny:qwen3"))
    dcfg = DraftModelConfig.from_config(cfg, 128, 2048, 6, [1, 3], MASK)
    torch.manual_seed(0)
    ours = DFlashDrafter(dcfg, embed, head).eval()
    save_drafter(ours, tmp_path / "ckpt")
    ref = ref_mod.DFlashDraftModel.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    ref.config._attn_implementation = "sdpa"
    assert ref.target_layer_ids == [1, 3] and ref.mask_token_id == MASK and ref.block_size == 8
    g = torch.Generator().manual_seed(0)
    S, B = 37, 8
    hidden = torch.randn(S, 2, 128, generator=g)
    ids = torch.full((1, B), MASK)
    ids[0, 0] = 77
    with torch.no_grad():
        h = ref(
            position_ids=torch.arange(S + B)[None],
            noise_embedding=F.embedding(ids, embed),
            target_hidden=hidden.reshape(1, S, -1),
            is_causal=False,
        )
        theirs = F.linear(h[0, 1:], head)
        mine = ours.draft_block(hidden, 77)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_reference_model_loads_a_sliding_window_checkpoint(tmp_path, checkout):
    """No missing or unexpected keys, and the reference's sliding layers get the window. (Their outputs
    are compared in the decode below, against a file whose attention masks the window.)"""
    ref_mod = reference_module(ref=checkout)
    cfg = load_config("configs/tiny.toml")
    cfg.drafter.dtype = "float32"
    cfg.drafter.num_hidden_layers = 3
    cfg.drafter.layer_types = ["sliding_attention", "sliding_attention", "full_attention"]
    cfg.drafter.sliding_window = 16
    embed, head = load_embed_and_head(TargetConfig(model="tiny:qwen3"))
    ours = DFlashDrafter(DraftModelConfig.from_config(cfg, 128, 2048, 6, [1, 3], MASK), embed, head)
    save_drafter(ours, tmp_path / "ckpt")
    ref, info = ref_mod.DFlashDraftModel.from_pretrained(
        tmp_path / "ckpt", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert [layer.self_attn.sliding_window for layer in ref.layers] == [16, 16, None]
    for name, p in ref.state_dict().items():
        if name in ours.state_dict():
            torch.testing.assert_close(p, ours.state_dict()[name])


GREEDY = (1, (5, 17, 40))  # the greedy decodes' prompts: seed, lengths
SAMPLED = (3, (6, 19, 33, 8, 25, 12))  # the sampled ones'


def prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 1500, (n,), generator=g) for n in lengths]


def _reference_pair(tmp_path, ref_mod, target, *, is_causal, sliding=False, architecture="dflash"):
    """One drafter checkpoint, loaded by both sides: started from the target's top layers and fitted to
    its greedy continuations of every prompt the decodes ask (``tests/planted.py``)."""
    from dflash_staged.model.drafters.init import init_from_target
    from dflash_staged.model.drafters.weights import load_drafter

    tcfg = TargetConfig(model="tiny:qwen3")
    cfg = load_config("configs/tiny.toml")
    cfg.drafter.dtype = "float32"
    cfg.drafter.is_causal = is_causal
    cfg.drafter.intermediate_size = 256
    cfg.drafter.architecture = architecture
    cfg.drafter.conv_group_size, cfg.drafter.selector_rank, cfg.drafter.selector_top_k = 16, 16, 8
    if sliding:
        cfg.drafter.layer_types = ["sliding_attention", "full_attention"]
        cfg.drafter.sliding_window = 12
    embed, head = load_embed_and_head(tcfg)
    torch.manual_seed(0)
    d = DFlashDrafter(DraftModelConfig.from_config(cfg, 128, 2048, 6, [1, 3], MASK), embed, head)
    key = (is_causal, sliding, architecture)
    if key not in _FITTED:
        init_from_target(d, tcfg)
        if architecture == "dflash2":  # a selector that changes the walk (its successor codebook starts at 0)
            with torch.no_grad():
                d.selector.successor_codebook.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
        fit_to_target(d, target, prompts(*GREEDY) + prompts(*SAMPLED), 29, steps=100, lr=3e-3)
        _FITTED[key] = {k: v.clone() for k, v in d.state_dict().items()}
    d.load_state_dict(_FITTED[key])
    save_drafter(d, tmp_path / "ckpt")
    ours = load_drafter(tmp_path / "ckpt", embed, head, device="cpu", dtype=torch.float32)
    cls = ref_mod.DFlash2DraftModel if architecture == "dflash2" else ref_mod.DFlashDraftModel
    ref = cls.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    ref.config._attn_implementation = "sdpa"
    return ours, ref


SETUPS = {  # each decode setup and what it needs of z-lab's file beside main's DFlash
    "bidirectional": ({"is_causal": False}, ()),
    "causal": ({"is_causal": True}, ("masks",)),
    "sliding": ({"is_causal": False, "sliding": True}, ("masks",)),
    "dflash2": ({"is_causal": False, "architecture": "dflash2"}, ("dflash2",)),
}


@pytest.fixture(params=list(SETUPS))
def greedy_setup(request, checkout):
    """(setup, z-lab's module): the bidirectional DFlash setup against each checkout given; the others
    against the first that has what they need."""
    setup, needs = SETUPS[request.param]
    if not needs:
        return setup, reference_module(ref=checkout)
    first = next((c for c in CHECKOUTS.values() if c and zlab_lacks(c, *needs) is None), None)
    if first is None:
        pytest.skip(zlab_lacks(DFLASH2_REF, *needs))
    if checkout != first:
        pytest.skip(f"compared once, against {first} (the first checkout given with {', '.join(needs)})")
    return setup, reference_module(*needs, ref=first)


@pytest.mark.parametrize("max_new", [24, 29])  # a multiple of the block size (8), and not
def test_greedy_decoding_equals_the_reference_harness_step_for_step(
    tmp_path, monkeypatch, greedy_setup, max_new
):
    """``speculative_generate`` against the reference ``dflash_generate`` on the same target and drafter:
    the same tokens, and the same drafts and acceptance length at every verify step both verify the
    same block; against a file that shortens its last blocks (07ebd93's) that is every step, the
    shortened last ones included (issue 35, item 1)."""
    from dflash_staged.evaluate.speculative import DrafterProposer, speculative_generate

    setup, ref_mod = greedy_setup
    legacy_crop(monkeypatch)  # main's dflash_generate crops its caches to a length (transformers 4.x)
    monkeypatch.setattr(ref_mod, "_cuda_time", time.perf_counter)  # its timing syncs CUDA: on a CPU, plain
    shortens = "verify_size" in inspect.getsource(ref_mod.dflash_generate)
    target = planted_target()
    ours, ref = _reference_pair(tmp_path, ref_mod, target, **setup)
    head = target.model.get_output_embeddings().weight
    drafts = {"ours": [], "ref": []}  # every block's drafts, as each side drafted them

    class Recording(DrafterProposer):
        def propose(self, *a, **k):
            out = super().propose(*a, **k)
            drafts["ours"].append(out.tolist())
            return out

    def record(module, args, out):  # its block's final-normed rows, the anchor's first: v1's drafts
        drafts["ref"].append(F.linear(out[0, 1:], head).argmax(-1).tolist())

    hook = ref.register_forward_hook(record)
    steps = compared = accepted = drafted = 0
    try:
        for prompt in prompts(*GREEDY):
            n = prompt.numel()
            drafts["ours"].clear()
            drafts["ref"].clear()
            mine = speculative_generate(target, Recording(ours), prompt, max_new, ())
            theirs = ref_mod.dflash_generate(
                ref, target.model, prompt[None], max_new, None, 0.0, return_stats=True
            )
            assert mine.tokens == theirs.output_ids[0, n:].tolist(), (setup, n)
            # the steps both verify the same block: all (a reference that shortens its last blocks as ours
            # does), else those where ours drafts a whole block, bar the last (whose bonus ours drops)
            last = len(mine.accepted) - 1
            same = [
                k
                for k in range(len(mine.accepted))
                if shortens or (len(drafts["ours"][k]) == len(drafts["ref"][k]) and k < last)
            ]
            assert {k for k in range(last) if len(drafts["ours"][k]) == ours.block_size - 1} <= set(same)
            lengths = [theirs.acceptance_lengths[k] for k in same]
            assert [mine.accepted[k] for k in same] == lengths, (setup, n)
            # the drafts too: the last ones drafted short (the accepted lengths alone rarely show it);
            # DFlash2's are its walk's (compared above through the tokens and lengths), not the unary argmax
            if setup.get("architecture") != "dflash2":
                assert [drafts["ours"][k] for k in same] == [drafts["ref"][k] for k in same], (setup, n)
            steps += len(mine.accepted)
            compared += len(same)
            a, d = acceptance(mine)
            accepted, drafted = accepted + a, drafted + d
    finally:
        hook.remove()
    assert accepted > 0.5 * drafted, (accepted, drafted)  # most drafts accepted: long accepted prefixes
    print(
        f"{setup} max_new {max_new} vs z-lab ({'shortens' if shortens else 'whole blocks'}): {compared} of "
        f"{steps} steps compared, all equal; drafts accepted {accepted}/{drafted}"
    )


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.95, 20)])
def test_sampled_decoding_equals_the_reference_harness_with_matched_draws(
    tmp_path, monkeypatch, architecture, top_p, top_k
):
    """At T = 1 both sides draw the same uniforms (tests/matched.py): the first token, each draft (v1:
    from the filtered logits; DFlash2: its selector's walk), each verify's uniforms and its last token.
    The same tokens and acceptance lengths at every verify step, not only the same distribution. Needs
    rejection-sampled decoding (07ebd93's ``_rejection_sample``; main's draws no drafts)."""
    from matched import matched_draws

    from dflash_staged.evaluate.sampling import Sampler, SamplingSettings
    from dflash_staged.evaluate.speculative import DrafterProposer, speculative_generate

    needs = ("sampling", "dflash2") if architecture == "dflash2" else ("sampling",)
    ref_mod = reference_module(*needs)
    monkeypatch.setattr(ref_mod, "_cuda_time", time.perf_counter)
    target = planted_target()
    ours, ref = _reference_pair(tmp_path, ref_mod, target, is_causal=False, architecture=architecture)
    sampler = Sampler(SamplingSettings(temperature=1.0, top_p=top_p, top_k=top_k))
    steps = accepted = drafted = 0
    for i, prompt in enumerate(prompts(*SAMPLED)):
        n = prompt.numel()
        with matched_draws(100 + i, monkeypatch) as draws:
            mine = speculative_generate(target, DrafterProposer(ours), prompt, 29, (), sampler=sampler)
            used = draws.used
        with matched_draws(100 + i, monkeypatch) as draws:
            theirs = ref_mod.dflash_generate(
                ref, target.model, prompt[None], 29, None, 1.0, top_p, top_k, return_stats=True
            )
            assert draws.used == used  # the same number of draws, in the same roles
        assert mine.tokens == theirs.output_ids[0, n:].tolist(), (architecture, n)
        assert mine.accepted == list(theirs.acceptance_lengths), (architecture, n)
        steps += len(mine.accepted)
        a, d = acceptance(mine)
        accepted, drafted = accepted + a, drafted + d
    assert drafted > accepted > 0.5 * drafted, (accepted, drafted)  # mostly accepted, some rejected
    print(
        f"{architecture} T=1 top-p {top_p} top-k {top_k}: {steps} sampled steps equal to z-lab's; "
        f"drafts accepted {accepted}/{drafted}"
    )
