import copy
import logging
import sys
import types

import pytest
import torch

from dflash_staged.config import TargetConfig
from dflash_staged.errors import DflashError
from dflash_staged.model.target import (
    KernelPreflightError,
    Target,
    crop_cache,
    load_target,
    load_tokenizer,
    pack_unpadded,
    pad_batch,
    preflight,
    preflight_kernels,
    resolve_dtype,
    resolve_layer_ids,
)
from dflash_staged.model.target.tiny import save_tiny_model, tiny_config

KINDS = ("qwen3", "qwen3_5", "qwen3_next", "qwen3_moe")
LENGTHS = (37, 5, 64, 20, 1)
_CACHE: dict = {}


def target(kind: str, dtype: str = "float32", layer_ids=None) -> Target:
    key = (kind, dtype, tuple(layer_ids or ()))
    if key not in _CACHE:
        cfg = TargetConfig(model=f"tiny:{kind}", dtype=dtype, target_layer_ids=list(layer_ids or []))
        _CACHE[key] = load_target(cfg, "cpu", num_draft_layers=3)
    return _CACHE[key]


def samples(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 2048, (n,), generator=g) for n in lengths]


# --- layer ids, dtype, batching helpers --------------------------------------------------


def test_resolve_layer_ids_rule_and_override():
    assert resolve_layer_ids(TargetConfig(), 36, 5) == [1, 9, 17, 25, 33]
    assert resolve_layer_ids(TargetConfig(), 6, 1) == [3]
    assert resolve_layer_ids(TargetConfig(target_layer_ids=[4, 0, 2]), 6, 5) == [4, 0, 2]


@pytest.mark.parametrize(
    "cfg,L,k,needle",
    [
        (TargetConfig(target_layer_ids=[1, 6]), 6, 1, "[6] are out of range"),
        (TargetConfig(), 4, 3, "repeated layer ids"),
    ],
)
def test_resolve_layer_ids_errors(cfg, L, k, needle):
    with pytest.raises(DflashError) as e:
        resolve_layer_ids(cfg, L, k)
    assert needle in str(e.value) and "target.target_layer_ids" in str(e.value)


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16


def test_pad_and_pack_roundtrip():
    seqs = samples((3, 1, 5))
    ids, mask, lengths = pad_batch(seqs, pad_id=0)
    assert ids.shape == mask.shape == (3, 5) and lengths.tolist() == [3, 1, 5]
    assert mask.sum().item() == 9 and (ids[mask == 0] == 0).all()
    packed = pack_unpadded(ids[:, :, None], lengths)
    assert torch.equal(packed[:, 0], torch.cat(seqs))
    with pytest.raises(ValueError):
        pad_batch([torch.tensor([5]), torch.tensor([], dtype=torch.long)])


# --- capture: taps are layer outputs, padding-independent, early-stopped ----------------


@pytest.mark.parametrize("kind", KINDS)
def test_capture_equals_hidden_states(kind):
    t = target(kind)
    ids = samples((24,))[0][None]
    taps = t.capture(ids)
    with torch.inference_mode():
        hs = t.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert taps.shape == (1, 24, len(t.layer_ids), t.hidden_size) and taps.dtype == torch.float32
    for k, i in enumerate(t.layer_ids):
        torch.testing.assert_close(taps[:, :, k], hs[i + 1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 0.0625)])
@pytest.mark.parametrize("kind", KINDS)
def test_padding_alone_vs_batched(kind, dtype, atol):
    t = target(kind, dtype)
    seqs = samples()
    ids, mask, lengths = pad_batch(seqs)
    packed = pack_unpadded(t.capture(ids, mask), lengths)
    alone = torch.cat([t.capture(s[None])[0] for s in seqs])
    assert packed.shape == (sum(LENGTHS), len(t.layer_ids), t.hidden_size)
    assert packed.dtype == getattr(torch, dtype)
    diff = (packed.float() - alone.float()).abs().max().item()
    assert diff <= atol, f"{kind} {dtype}: alone vs batched max abs diff {diff}"


@pytest.mark.parametrize("kind", ("qwen3", "qwen3_5"))
def test_early_stop_skips_later_modules(kind):
    t = target(kind, layer_ids=[1, 3])
    fired = []
    later = [t.layers[i] for i in range(4, t.num_layers)] + [t.model.model.norm, t.model.lm_head]
    handles = [m.register_forward_hook(lambda *a, m=m: fired.append(m)) for m in later]
    seen = []
    handles.append(t.layers[3].register_forward_hook(lambda *a: seen.append(3)))
    try:
        t.capture(*pad_batch(samples((9, 4)))[:2])
    finally:
        for h in handles:
            h.remove()
    assert seen == [3] and fired == []
    # the tap hooks are removed afterwards: a plain forward runs the whole model again
    with torch.inference_mode():
        assert t.model(input_ids=samples((3,))[0][None]).logits.shape == (1, 3, t.vocab_size)


def test_nested_multimodal_layers_are_found():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    cfg = Qwen3_5Config(
        text_config=tiny_config("qwen3_5").to_dict(),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256),
    )
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    t = Target(model, [1, 6], "test", "cpu")
    assert t.layers is model.model.language_model.layers and t.is_hybrid and t.num_layers == 8
    ids = samples((10,))[0][None]
    with torch.inference_mode():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    taps = t.capture(ids)
    torch.testing.assert_close(taps[:, :, 0], hs[2], rtol=0, atol=0)
    torch.testing.assert_close(taps[:, :, 1], hs[7], rtol=0, atol=0)


def test_target_attributes():
    t = target("qwen3_5")
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (8, 256, 2048)
    assert t.layer_ids == [1, 3, 5] and t.is_hybrid and not t.supports_crop
    assert t.target_id.startswith("tiny:qwen3_5@seed0:cfg-") and t.dtype == torch.float32
    assert not target("qwen3").is_hybrid and target("qwen3").target_id != t.target_id


# --- loading from a local directory -----------------------------------------------------


def test_load_local_dir_matches_tiny(tmp_path):
    d = save_tiny_model(tmp_path / "m", "qwen3")
    local = load_target(TargetConfig(model=str(d), dtype="bfloat16"), "cpu", layer_ids=[0, 5])
    tiny = target("qwen3", "bfloat16", layer_ids=[0, 5])
    assert local.dtype == torch.bfloat16
    assert local.model.model.rotary_emb.inv_freq.dtype == torch.float32  # dtype= at load, not .to()
    assert local.target_id.startswith(f"{d}@files-")
    assert local.target_id.split(":cfg-")[1] == tiny.target_id.split(":cfg-")[1]
    ids = samples((12,))[0][None]
    assert torch.equal(local.capture(ids), tiny.capture(ids))
    tok = load_tokenizer(TargetConfig(model=str(d)))
    assert tok.pad_token_id == 0 and len(tok.encode("hello world")) > 0


def test_load_errors(tmp_path):
    with pytest.raises(DflashError, match="tiny:qwen3, tiny:qwen3_5"):
        load_target(TargetConfig(model="tiny:llama"), "cpu")
    with pytest.raises(DflashError, match="cannot load the target config"):
        load_target(TargetConfig(model=str(tmp_path / "missing")), "cpu")
    with pytest.raises(DflashError, match="out of range"):
        load_target(TargetConfig(model="tiny:qwen3", target_layer_ids=[6]), "cpu")


# --- full forward with taps and a KV cache ----------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_forward_with_taps_and_cache_continuation(kind):
    t = target(kind)
    ids = samples((16,))[0][None]
    logits, taps, cache = t.forward_with_taps(ids)
    with torch.inference_mode():
        ref = t.model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(taps, t.capture(ids), rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 16
    l1, t1, c1 = t.forward_with_taps(ids[:, :10])
    l2, t2, c2 = t.forward_with_taps(ids[:, 10:], past_key_values=c1)
    torch.testing.assert_close(torch.cat([l1, l2], 1), logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.cat([t1, t2], 1), taps, rtol=0, atol=1e-4)
    assert c2.get_seq_length() == 16


def test_crop_dense_cache():
    t = target("qwen3")
    ids = samples((16,))[0][None]
    logits, _, _ = t.forward_with_taps(ids)
    _, _, cache = t.forward_with_taps(ids[:, :12])
    _, _, cache = t.forward_with_taps(torch.tensor([[7, 8, 9]]), past_key_values=cache)  # a rejected draft
    crop_cache(cache, 12)
    assert cache.get_seq_length() == 12
    l2, _, _ = t.forward_with_taps(ids[:, 12:], past_key_values=cache)
    torch.testing.assert_close(l2, logits[:, 12:], rtol=0, atol=1e-4)
    with pytest.raises(ValueError):
        crop_cache(cache, 40)


def test_hybrid_cache_cannot_be_cropped_but_can_be_copied():
    t = target("qwen3_5")
    ids = samples((14,))[0][None]
    logits, _, _ = t.forward_with_taps(ids)
    _, _, cache = t.forward_with_taps(ids[:, :10])
    snapshot = copy.deepcopy(cache)
    t.forward_with_taps(torch.tensor([[7, 8]]), past_key_values=cache)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        crop_cache(cache, 10)
    l2, _, _ = t.forward_with_taps(ids[:, 10:], past_key_values=snapshot)
    torch.testing.assert_close(l2, logits[:, 10:], rtol=0, atol=1e-4)


# --- kernel preflight ---------------------------------------------------------------------


def _no_kernels(monkeypatch, *packages):
    for p in packages:  # a None entry makes `import p` raise ImportError
        monkeypatch.setitem(sys.modules, p, None)


def test_preflight_refuses_hybrid_on_cuda_without_kernels(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _no_kernels(monkeypatch, "fla", "fla.ops", "fla.ops.gated_delta_rule", "causal_conv1d")
    for kind in ("qwen3_5", "qwen3_next"):
        with pytest.raises(KernelPreflightError) as e:
            preflight_kernels(tiny_config(kind), "cuda:0", allow_slow=False)
        msg = str(e.value)
        assert "flash-linear-attention" in msg and "causal-conv1d" not in msg  # only fla refuses
        assert "pip install 'dflash-staged[cuda]'" in msg and "--allow-slow-kernels" in msg
    preflight_kernels(tiny_config("qwen3"), "cuda:0", allow_slow=False)  # dense: nothing needed
    with pytest.raises(KernelPreflightError):  # load_target refuses before building the model
        load_target(TargetConfig(model="tiny:qwen3_5"), "cuda:0")


def _fake_fla(monkeypatch):
    fla = types.ModuleType("fla.ops.gated_delta_rule")
    fla.chunk_gated_delta_rule = fla.fused_recurrent_gated_delta_rule = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fla)


def _conv_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "without the causal-conv1d kernel" in r.getMessage()]


def test_preflight_a_missing_causal_conv1d_is_a_warning_not_a_refusal(monkeypatch, caplog):
    # transformers falls back to a depthwise F.conv1d for it (cheap); only the fla fallback is slow
    _fake_fla(monkeypatch)
    _no_kernels(monkeypatch, "causal_conv1d")
    monkeypatch.setattr(preflight, "_smoke", lambda *a: None)
    with caplog.at_level(logging.WARNING, logger="dflash_staged.model.target.preflight"):
        preflight_kernels(tiny_config("qwen3_5"), "cuda", allow_slow=False)  # no raise
    (msg,) = _conv_warnings(caplog)
    assert "causal-conv1d (import 'causal_conv1d' failed" in msg and "depthwise conv1d" in msg
    assert "flash-linear-attention" not in msg
    caplog.clear()
    conv = types.ModuleType("causal_conv1d")
    conv.causal_conv1d_fn = conv.causal_conv1d_update = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "causal_conv1d", conv)
    with caplog.at_level(logging.WARNING, logger="dflash_staged.model.target.preflight"):
        preflight_kernels(tiny_config("qwen3_5"), "cuda", allow_slow=False)  # both present and usable
    assert not caplog.records

    def conv_broken(package, fns, device):
        if package == "causal_conv1d":
            raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(preflight, "_smoke", conv_broken)
    with caplog.at_level(logging.WARNING, logger="dflash_staged.model.target.preflight"):
        preflight_kernels(tiny_config("qwen3_5"), "cuda", allow_slow=False)  # a broken one: a warning too
    assert "kernel failed on cuda: RuntimeError: no kernel image" in _conv_warnings(caplog)[0]


def test_preflight_names_only_the_missing_package(monkeypatch, caplog):
    _no_kernels(monkeypatch, "fla", "fla.ops", "fla.ops.gated_delta_rule")
    conv = types.ModuleType("causal_conv1d")
    conv.causal_conv1d_fn = conv.causal_conv1d_update = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "causal_conv1d", conv)
    monkeypatch.setattr(preflight, "_smoke", lambda *a: None)
    with pytest.raises(KernelPreflightError) as e:
        preflight_kernels(tiny_config("qwen3_5"), "cuda", allow_slow=False)
    assert "flash-linear-attention" in str(e.value) and "causal-conv1d" not in str(e.value)
    _fake_fla(monkeypatch)

    def broken(package, fns, device):
        raise RuntimeError("0 active drivers")

    monkeypatch.setattr(preflight, "_smoke", broken)
    with pytest.raises(KernelPreflightError, match="kernel failed on cuda: RuntimeError: 0 active drivers"):
        preflight_kernels(tiny_config("qwen3_5"), "cuda", allow_slow=False)


def test_preflight_allow_slow_warns(monkeypatch, caplog):
    _no_kernels(monkeypatch, "fla", "causal_conv1d")
    with caplog.at_level(logging.WARNING, logger="dflash_staged.model.target.preflight"):
        preflight_kernels(tiny_config("qwen3_next"), "cuda:0", allow_slow=True)
    assert any(
        "without fast kernels" in r.getMessage() and "flash-linear-attention" in r.getMessage()
        for r in caplog.records
    )
    assert _conv_warnings(caplog)


def test_preflight_cpu_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(preflight, "_cpu_logged", False)
    with caplog.at_level(logging.WARNING, logger="dflash_staged.model.target.preflight"):
        for _ in range(3):
            preflight_kernels(tiny_config("qwen3_5"), "cpu", allow_slow=False)
        preflight_kernels(tiny_config("qwen3"), "cpu", allow_slow=False)
    msgs = [r.getMessage() for r in caplog.records if "reference fallbacks" in r.getMessage()]
    assert len(msgs) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_bf16_capture_matches_alone(kind):
    cfg = TargetConfig(model=f"tiny:{kind}", allow_slow_kernels=True)
    t = load_target(cfg, "cuda", num_draft_layers=3)
    assert t.dtype == torch.bfloat16
    seqs = samples()
    ids, mask, lengths = pad_batch(seqs, device="cuda")
    packed = pack_unpadded(t.capture(ids, mask), lengths).float()
    alone = torch.cat([t.capture(s[None].cuda())[0] for s in seqs]).float()
    assert (packed - alone).abs().max().item() <= 0.0625
