"""Reference-format drafter checkpoints, target embedding/head loading, mask-token checks."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_staged.config import TargetConfig, load_config
from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
from dflash_staged.model.drafters.weights import (
    check_mask_absent,
    load_drafter,
    read_drafter_config,
    save_drafter,
    validate_mask_token,
)
from dflash_staged.model.target.tiny import MASK, build_tiny_model, build_tiny_tokenizer, save_tiny_model
from dflash_staged.model.target.weights import load_embed_and_head


@pytest.fixture(scope="module")
def tiny_head():
    return load_embed_and_head(TargetConfig(model="tiny:qwen3"))


def tiny_drafter(tiny_head, dtype="float32", layers=2):
    cfg = load_config("configs/tiny.toml")
    cfg.drafter.dtype = dtype
    cfg.drafter.num_hidden_layers = layers
    dcfg = DraftModelConfig.from_config(
        cfg, target_hidden=128, target_vocab=2048, num_target_layers=6, layer_ids=[1, 3], mask_token_id=MASK
    )
    torch.manual_seed(0)
    return DFlashDrafter(dcfg, *tiny_head)


def reference_names(layers):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(layers):
        p = f"layers.{i}."
        names |= {
            p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        }
        names |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    return names


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(50, 2, 128, generator=g), torch.randint(4, 2048, (50,), generator=g)


def test_round_trip_gives_identical_logits(tmp_path, tiny_head):
    m = tiny_drafter(tiny_head).eval()
    save_drafter(m, tmp_path / "ckpt")
    m2 = load_drafter(tmp_path / "ckpt", *tiny_head).eval()
    hidden, ids = batch()
    cu, anchors = torch.tensor([0, 20, 50]), torch.tensor([3, 11, 25, 40])
    with torch.no_grad():
        assert torch.equal(
            m.forward_train(hidden, ids, cu, anchors), m2.forward_train(hidden, ids, cu, anchors)
        )
        assert torch.equal(m.draft_block(hidden[:17], ids[17]), m2.draft_block(hidden[:17], ids[17]))
    assert m2.dcfg == m.dcfg


def test_checkpoint_matches_reference_format(tmp_path, tiny_head):
    m = tiny_drafter(tiny_head, dtype="bfloat16", layers=3)
    out = save_drafter(m, tmp_path / "ckpt")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == 3
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": MASK, "block_size": 8}
    assert cfg["layer_types"] == ["full_attention"] * 3
    assert cfg["dtype"] == "bfloat16" and cfg["vocab_size"] == 2048 and cfg["hidden_size"] == 128
    assert cfg["rope_theta"] == 1e6 and cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    for key in (
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "hidden_act",
    ):
        assert key in cfg
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert keys == reference_names(3)  # and so no embedding / LM head
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)
        assert f.get_slice("fc.weight").get_shape() == [128, 256]
        torch.testing.assert_close(f.get_tensor("fc.weight"), m.fc.weight.detach().bfloat16())


def test_transformers_reads_the_config(tmp_path, tiny_head):
    from transformers import AutoConfig

    save_drafter(tiny_drafter(tiny_head), tmp_path / "ckpt")
    hf = AutoConfig.from_pretrained(tmp_path / "ckpt")
    assert type(hf).__name__ == "Qwen3Config" and hf.architectures == ["DFlashDraftModel"]
    assert hf.rope_parameters["rope_theta"] == 1e6 and hf.block_size == 8 and hf.num_target_layers == 6
    assert hf.dflash_config["mask_token_id"] == MASK and hf.num_key_value_heads == 2 and hf.head_dim == 32


def test_released_style_config_is_read(tmp_path):
    released = {  # the shape of a transformers-5 era release (Qwen3.5 drafters)
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "torch_dtype": "bfloat16",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 500,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000},
        "max_position_embeddings": 262144,
        "num_target_layers": 32,
        "layer_types": ["full_attention", "full_attention"],
        "dflash_config": {"block_size": 16, "mask_token_id": 499, "target_layer_ids": [1, 8, 15, 22, 29]},
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    }
    c = DraftModelConfig.from_dict(released)
    assert (c.block_size, c.rope_theta, c.dtype, c.mask_token_id) == (16, 1e7, "bfloat16", 499)
    assert c.target_layer_ids == [1, 8, 15, 22, 29] and c.rope_scaling is None
    assert c.to_dict()["auto_map"] == released["auto_map"]  # unknown keys survive a round trip
    legacy = dict(
        released,
        rope_theta=1e6,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    )
    del legacy["rope_parameters"]
    y = DraftModelConfig.from_dict(legacy)
    assert y.rope_parameters == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "rope_theta": 1e6,
    }
    g = torch.Generator().manual_seed(0)
    m = DFlashDrafter(y, torch.randn(500, 64, generator=g), torch.randn(500, 64, generator=g))
    assert m.rope_scale != 1.0  # yarn scales cos/sin
    hybrid = dict(
        released,
        layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=2048,
    )  # as SpecForge's Qwen3.6-27B drafter (4 sliding + 1 full there)
    h = DraftModelConfig.from_dict(hybrid)
    assert (h.layer_types, h.sliding_window, h.use_sliding_window) == (hybrid["layer_types"], 2048, True)
    assert {k: h.to_dict()[k] for k in ("layer_types", "sliding_window", "use_sliding_window")} == {
        k: hybrid[k] for k in ("layer_types", "sliding_window", "use_sliding_window")
    }
    with pytest.raises(DflashError, match="use_sliding_window is not true"):
        DraftModelConfig.from_dict(dict(released, layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(DflashError, match="sliding_window=None"):
        DraftModelConfig.from_dict(
            dict(released, layer_types=["sliding_attention", "full_attention"], use_sliding_window=True)
        )
    with pytest.raises(DflashError, match="layer_types has 1 entries for 2 layers"):
        DraftModelConfig.from_dict(dict(released, layer_types=["full_attention"]))
    with pytest.raises(DflashError, match="not a drafter this project trains"):
        DraftModelConfig.from_dict(dict(released, architectures=["Qwen3ForCausalLM"]))
    with pytest.raises(DflashError, match="missing field 'vocab_size'"):
        DraftModelConfig.from_dict({k: v for k, v in released.items() if k != "vocab_size"})


def test_rope_scaling_reaches_the_installed_transformers():
    """The RoPE tables come from transformers' own init functions, which read rope_parameters (5.x) or
    rope_theta + rope_scaling (4.x, the floor): linear scaling must divide the frequencies either way."""
    kw = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=500,
        block_size=4,
        num_target_layers=8,
        target_layer_ids=[1],
        mask_token_id=499,
        rope_theta=1e4,
    )
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(500, 64, generator=g)
    plain = DFlashDrafter(DraftModelConfig(**kw), embed, embed)
    linear = DFlashDrafter(
        DraftModelConfig(**kw, rope_scaling={"rope_type": "linear", "factor": 4.0}), embed, embed
    )
    torch.testing.assert_close(linear.inv_freq, plain.inv_freq / 4)
    assert plain.inv_freq[1].item() == pytest.approx(1e4 ** (-2 / 16))


def test_sliding_window_layers_round_trip(tmp_path, tiny_head):
    import dataclasses

    m = tiny_drafter(tiny_head, layers=3)
    c = dataclasses.replace(
        m.dcfg, layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=6
    )
    m = DFlashDrafter(c, *tiny_head)
    save_drafter(m, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert (
        cfg["layer_types"] == c.layer_types
        and cfg["sliding_window"] == 6
        and cfg["use_sliding_window"] is True
    )
    m2 = load_drafter(tmp_path / "ckpt", *tiny_head)
    assert m2.dcfg.layer_types == c.layer_types and [layer.self_attn.window for layer in m2.layers] == [
        6,
        6,
        0,
    ]
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tmp_path / "ckpt")  # what the reference class is built from
    assert hf.layer_types == c.layer_types and hf.sliding_window == 6
    # the full-attention default writes what it always did
    assert (
        DraftModelConfig(**{**c.__dict__, "layer_types": [], "sliding_window": None}).to_dict()[
            "sliding_window"
        ]
        is None
    )


def test_save_replaces_atomically_and_cleans_up(tmp_path, tiny_head, monkeypatch):
    m = tiny_drafter(tiny_head)
    target = tmp_path / "ckpt"
    save_drafter(m, target)
    before = (target / "model.safetensors").read_bytes()
    with torch.no_grad():
        m.fc.weight.add_(1.0)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", boom)
    with pytest.raises(OSError):
        save_drafter(m, target)
    assert (target / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp leftovers
    monkeypatch.undo()
    save_drafter(m, target)
    assert (target / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_load_errors_name_the_problem(tmp_path, tiny_head):
    with pytest.raises(DflashError, match="cannot read the drafter config"):
        read_drafter_config(tmp_path)
    m = tiny_drafter(tiny_head)
    save_drafter(m, tmp_path / "ckpt")
    state = {k: v for k, v in m.state_dict().items() if k != "norm.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(DflashError, match="missing \\['norm.weight'\\]"):
        load_drafter(tmp_path / "ckpt", *tiny_head)
    with pytest.raises(DflashError, match="wrong target"):
        load_drafter(tmp_path / "ckpt", torch.zeros(2048, 64), torch.zeros(2048, 64))


def test_embed_and_head_from_tiny_and_local_dir(tmp_path, tiny_head):
    model = build_tiny_model("qwen3")
    embed, head = tiny_head
    assert torch.equal(embed, model.model.embed_tokens.weight) and torch.equal(head, model.lm_head.weight)
    assert not torch.equal(embed, head)
    save_tiny_model(tmp_path / "tiny", "qwen3")
    e2, h2 = load_embed_and_head(TargetConfig(model=str(tmp_path / "tiny")))
    assert torch.equal(e2, embed) and torch.equal(h2, head)
    e3, h3 = load_embed_and_head(TargetConfig(model=str(tmp_path / "tiny")), dtype=torch.bfloat16)
    assert e3.dtype == h3.dtype == torch.bfloat16


def test_tied_embeddings(tmp_path):
    d = tmp_path / "tied"
    d.mkdir()
    w = torch.randn(100, 16)
    save_file(
        {"model.embed_tokens.weight": w, "model.norm.weight": torch.ones(16)}, str(d / "model.safetensors")
    )
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    e, h = load_embed_and_head(TargetConfig(model=str(d)))
    assert torch.equal(e, w) and h is e


def test_multimodal_sharded_reads_only_needed_shards(tmp_path):
    d = tmp_path / "qwen35"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    e, h = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
    save_file({"model.language_model.embed_tokens.weight": e}, str(d / "model-00001-of-00003.safetensors"))
    save_file({"lm_head.weight": h}, str(d / "model-00003-of-00003.safetensors"))
    (d / "model-00002-of-00003.safetensors").write_bytes(b"not really a safetensors file")
    weight_map = {
        "model.language_model.embed_tokens.weight": "model-00001-of-00003.safetensors",
        "model.visual.blocks.0.attn.qkv.weight": "model-00002-of-00003.safetensors",
        "model.language_model.layers.0.mlp.up_proj.weight": "model-00002-of-00003.safetensors",
        "lm_head.weight": "model-00003-of-00003.safetensors",
    }
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_5",
                "text_config": {"tie_word_embeddings": False},
                "tie_word_embeddings": False,
            }
        )
    )
    e2, h2 = load_embed_and_head(TargetConfig(model=str(d)))
    assert torch.equal(e2, e) and torch.equal(h2, h)


def test_gguf_embedding_and_head(tmp_path):
    from gguf import GGUFWriter

    g = np.random.default_rng(0)
    e = g.standard_normal((40, 8)).astype(np.float32)
    h = g.standard_normal((40, 8)).astype(np.float32)
    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "qwen3")
    w.add_tensor("token_embd.weight", e)
    w.add_tensor("output.weight", h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    e2, h2 = load_embed_and_head(TargetConfig(model=str(tmp_path), gguf_file="m.gguf"))
    assert torch.equal(e2, torch.from_numpy(e)) and torch.equal(h2, torch.from_numpy(h))


def test_missing_local_or_offline_hub_target_is_a_user_error(tmp_path, monkeypatch):
    with pytest.raises(DflashError, match="not a model directory"):
        load_embed_and_head(TargetConfig(model=str(tmp_path / "nope")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(DflashError, match="cannot fetch"):
        load_embed_and_head(TargetConfig(model="someone/not-cached-model"))


def test_mask_token_validation():
    tok = build_tiny_tokenizer()
    n = len(tok)
    assert n < 2048
    assert validate_mask_token(-1, tok, 2048) == n  # the released drafters' choice: first unused row
    assert validate_mask_token(2047, tok, 2048) == 2047
    assert validate_mask_token(MASK, tok, 2048) == MASK  # a special token
    with pytest.raises(DflashError, match="ordinary token"):
        validate_mask_token(100, tok, 2048)
    with pytest.raises(DflashError, match="outside"):
        validate_mask_token(2048, tok, 2048)
    with pytest.raises(DflashError, match="special token"):
        validate_mask_token(-1, tok, n)  # tokenizer fills the vocabulary
    check_mask_absent(torch.tensor([4, 5, 6]), MASK)
    with pytest.raises(DflashError, match="contains the mask token"):
        check_mask_absent(torch.tensor([4, MASK]), MASK, "shard 7")


def test_bf16_checkpoint_and_bf16_inputs(tmp_path, tiny_head):
    from dflash_staged.train.objective import dflash_loss

    m = tiny_drafter(tiny_head, dtype="bfloat16").eval()
    save_drafter(m, tmp_path / "ckpt")
    e16, h16 = (t.bfloat16() for t in tiny_head)
    m16 = load_drafter(tmp_path / "ckpt", e16, h16, dtype=None).eval()  # as config.json declares
    assert {p.dtype for p in m16.parameters()} == {torch.bfloat16}
    m32 = load_drafter(tmp_path / "ckpt", e16, h16).eval()  # fp32 params, bf16 frozen tensors and features
    assert {p.dtype for p in m32.parameters()} == {
        torch.float32
    } and m32.lm_head_weight.dtype == torch.bfloat16
    hidden, ids = batch()
    hidden = hidden.bfloat16()
    with torch.no_grad():
        a, b = m16.draft_block(hidden[:30], ids[30]).float(), m32.draft_block(hidden[:30], ids[30]).float()
        ref = m.draft_block(hidden[:30].float(), ids[30])
    assert (a - ref).abs().max() < 0.05 * ref.abs().max() and (b - ref).abs().max() < 0.05 * ref.abs().max()
    b_ = {
        "hidden": hidden,
        "input_ids": ids,
        "loss_mask": torch.ones(50),
        "cu_seqlens": torch.tensor([0, 50]),
    }
    loss, _ = dflash_loss(m32, b_, 8, 4.0, torch.Generator().manual_seed(0))
    loss.backward()
    assert torch.isfinite(loss) and m32.fc.weight.grad is not None


def test_config_json_fields_read_as_the_reference_reads_them():
    """output_multiplier, final_logit_softcapping and input_embedding_scale from dflash_config, else from
    the top level; a negative softcap is refused; the scale survives the round trip (issue 35, item 3)."""
    from dflash_staged.errors import DflashError
    from dflash_staged.model.drafters.config import DraftModelConfig

    from helpers import make_drafter

    d = make_drafter().dcfg.to_dict()
    d["final_logit_softcapping"] = 30.0  # top level, as some released configs put it
    d["input_embedding_scale"] = 2.0
    c = DraftModelConfig.from_dict(d)
    assert c.final_logit_softcapping == 30.0 and c.input_embedding_scale == 2.0
    again = c.to_dict()
    assert again["dflash_config"]["final_logit_softcapping"] == 30.0
    assert again["dflash_config"]["input_embedding_scale"] == 2.0
    assert DraftModelConfig.from_dict(again) == c
    d["dflash_config"]["final_logit_softcapping"] = 20.0  # dflash_config wins
    assert DraftModelConfig.from_dict(d).final_logit_softcapping == 20.0
    d["dflash_config"]["final_logit_softcapping"] = -30.0
    with pytest.raises(DflashError, match="final_logit_softcapping=-30.0 must be > 0"):
        DraftModelConfig.from_dict(d)


def test_input_embedding_scale_scales_the_blocks_inputs_in_training_and_eval():
    import torch

    from helpers import make_drafter, packed_batch

    a, b = make_drafter().eval(), make_drafter(input_embedding_scale=3.0).eval()
    tok = torch.tensor([5])
    torch.testing.assert_close(b._block_input(tok), 3.0 * a._block_input(tok))
    batch = packed_batch([20])
    with torch.no_grad():
        assert not torch.allclose(
            a.draft_block(batch["hidden"][:10], 5), b.draft_block(batch["hidden"][:10], 5)
        )
