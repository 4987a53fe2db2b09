"""Cross-check against the public reference implementation (z-lab/dflash ``dflash/model.py``).

Skipped unless ``DFLASH_REFERENCE_MODEL_PY`` names a local copy of that file (nothing is
downloaded at test time). It loads our checkpoint with the reference class
(``DFlashDraftModel.from_pretrained``) and compares its block logits with ours.
"""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from dflash_staged.config import TargetConfig, load_config
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
from dflash_staged.model.drafters.weights import save_drafter
from dflash_staged.model.target.tiny import MASK
from dflash_staged.model.target.weights import load_embed_and_head

REF = os.environ.get("DFLASH_REFERENCE_MODEL_PY", "")
needs_ref = pytest.mark.skipif(
    not REF, reason="set DFLASH_REFERENCE_MODEL_PY to z-lab/dflash's dflash/model.py"
)


def reference_module():
    spec = importlib.util.spec_from_file_location("dflash_reference_model", REF)
    ref_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref_mod)
    return ref_mod


@needs_ref
def test_reference_model_loads_our_checkpoint_and_agrees(tmp_path):
    ref_mod = reference_module()
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


@needs_ref
def test_reference_model_loads_a_sliding_window_checkpoint(tmp_path):
    """No missing or unexpected keys, and the reference's sliding layers get the window. (Their outputs
    are not compared: with SDPA the reference ignores the window and keeps the block bidirectional,
    see dflash_staged/model/drafters/attention.py for which engines agree with ours.)"""
    ref_mod = reference_module()
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


def _reference_pair(tmp_path, ref_mod, *, is_causal, sliding=False, architecture="dflash"):
    """The tiny target (its HF model for the reference harness, our Target for ours) and one drafter
    checkpoint (started from the target's top layers, so drafts are often accepted), loaded by both."""
    from dflash_staged.model.drafters.init import init_from_target
    from dflash_staged.model.drafters.weights import load_drafter
    from dflash_staged.model.target import load_target

    tcfg = TargetConfig(model="tiny:qwen3")
    target = load_target(tcfg, "cpu", layer_ids=[1, 3])
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
    init_from_target(d, tcfg)
    if architecture == "dflash2":  # a selector that changes the walk (its successor codebook starts at 0)
        with torch.no_grad():
            d.selector.successor_codebook.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    save_drafter(d, tmp_path / "ckpt")
    ours = load_drafter(tmp_path / "ckpt", embed, head, device="cpu", dtype=torch.float32)
    cls = ref_mod.DFlash2DraftModel if architecture == "dflash2" else ref_mod.DFlashDraftModel
    ref = cls.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    ref.config._attn_implementation = "sdpa"
    return target, ours, ref


@needs_ref
@pytest.mark.parametrize(
    "setup",
    [
        {"is_causal": False},
        {"is_causal": True},
        {"is_causal": False, "sliding": True},
        {"is_causal": False, "architecture": "dflash2"},
    ],
)
@pytest.mark.parametrize("max_new", [24, 29])  # a multiple of the block size (8), and not
def test_eval_takes_the_reference_harnesss_steps_to_the_last_token(tmp_path, setup, max_new):
    """``speculative_generate`` against the reference ``dflash_generate`` on the same target and drafter:
    the same tokens and the same acceptance length at every verify step, the last (shortened)
    blocks included (issue 35, item 1)."""
    import time

    from dflash_staged.evaluate.speculative import DrafterProposer, speculative_generate

    ref_mod = reference_module()
    ref_mod._cuda_time = time.perf_counter  # its timing synchronises CUDA: on a CPU, plain time
    target, ours, ref = _reference_pair(tmp_path, ref_mod, **setup)
    drafts = {"ours": [], "ref": []}  # every block's drafts, as each side drafted them

    class Recording(DrafterProposer):
        def propose(self, *a, **k):
            out = super().propose(*a, **k)
            drafts["ours"].append(out.tolist())
            return out

    real = type(ref).compute_logits

    def compute_logits(model, hidden, head):
        logits = real(model, hidden, head)
        drafts["ref"].append(logits[0].argmax(-1).tolist())
        return logits

    type(ref).compute_logits = compute_logits
    g = torch.Generator().manual_seed(1)
    total = 0
    try:
        for n in (5, 17, 40):
            prompt = torch.randint(4, 1500, (n,), generator=g)
            mine = speculative_generate(target, Recording(ours), prompt, max_new, ())
            theirs = ref_mod.dflash_generate(
                ref, target.model, prompt[None], max_new, None, return_stats=True
            )
            assert mine.tokens == theirs.output_ids[0, n:].tolist(), (setup, n)
            assert mine.accepted == list(theirs.acceptance_lengths), (setup, n)
            # the blocks' drafts too: the last ones drafted short (the accepted lengths alone rarely show it);
            # DFlash2's are its walk's (compared above through the tokens and lengths), not the unary argmax
            if setup.get("architecture") != "dflash2":
                assert drafts["ours"] == drafts["ref"], (setup, n)
            total += sum(a > 1 for a in mine.accepted)
    finally:
        type(ref).compute_logits = real
    assert total > 0  # some drafts were accepted: the comparison is not between empty walks


@needs_ref
@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.95, 20)])
def test_sampled_decoding_equals_the_reference_harness_with_matched_draws(
    tmp_path, monkeypatch, architecture, top_p, top_k
):
    """At T = 1 both sides draw the same uniforms (tests/matched.py): the first token, each draft (v1:
    from the filtered logits; DFlash2: its selector's walk), each verify's uniforms and its last token.
    The same tokens and acceptance lengths at every verify step, not only the same distribution."""
    import time

    from matched import matched_draws

    from dflash_staged.evaluate.sampling import Sampler, SamplingSettings
    from dflash_staged.evaluate.speculative import DrafterProposer, speculative_generate

    ref_mod = reference_module()
    ref_mod._cuda_time = time.perf_counter
    target, ours, ref = _reference_pair(tmp_path, ref_mod, is_causal=False, architecture=architecture)
    sampler = Sampler(SamplingSettings(temperature=1.0, top_p=top_p, top_k=top_k))
    g = torch.Generator().manual_seed(3)
    steps = accepted = 0
    for i, n in enumerate((6, 19, 33, 8, 25, 12)):
        prompt = torch.randint(4, 1500, (n,), generator=g)
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
        accepted += sum(a > 1 for a in mine.accepted)
    assert accepted > 0  # drafts were accepted as well as rejected: both branches compared
    print(f"{architecture} T=1 top-p {top_p} top-k {top_k}: {steps} sampled steps equal to z-lab's")
