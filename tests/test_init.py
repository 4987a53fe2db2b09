"""Initialising the drafter from the target's top layers (drafter.init = "auto" | "target_top")."""

from __future__ import annotations

import pytest
import torch

from dflash_staged.config import Config, TargetConfig
from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
from dflash_staged.model.drafters.init import init_from_target
from dflash_staged.model.target.dims import target_dims
from dflash_staged.model.target.tiny import MASK
from dflash_staged.model.target.weights import load_embed_and_head, open_target_tensors


def drafter_for(kind: str, layers: int = 2, taps=(1, 3), **drafter_kw) -> tuple[DFlashDrafter, TargetConfig]:
    tcfg = TargetConfig(model=f"tiny:{kind}")
    cfg = Config(target=tcfg)
    target = open_target_tensors(tcfg).config
    cfg.drafter.num_hidden_layers = layers
    cfg.drafter.num_attention_heads = target["num_attention_heads"]
    cfg.drafter.num_key_value_heads = target["num_key_value_heads"]
    cfg.drafter.head_dim = target["head_dim"]
    cfg.drafter.intermediate_size = target["intermediate_size"]
    for k, v in drafter_kw.items():
        setattr(cfg.drafter, k, v)
    dims = target_dims(tcfg)
    embed, head = load_embed_and_head(tcfg)
    dcfg = DraftModelConfig.from_config(
        cfg, dims.hidden_size, dims.vocab_size, dims.num_layers, list(taps), MASK
    )
    torch.manual_seed(0)
    return DFlashDrafter(dcfg, embed, head), tcfg


def test_target_top_copies_the_last_layers_and_starts_fc_as_the_deepest_tap():
    d, tcfg = drafter_for("qwen3", layers=2, taps=(1, 3, 4))
    copied = init_from_target(d, tcfg)
    t = open_target_tensors(tcfg)
    p = dict(d.named_parameters())
    for i, j in ((0, 4), (1, 5)):  # 6 target layers: the drafter's 2 take the last 2, in order
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ):
            assert torch.equal(p[f"layers.{i}.{name}.weight"], t.get(f"model.layers.{j}.{name}.weight")), (
                i,
                name,
            )
    assert torch.equal(p["norm.weight"], t.get("model.norm.weight"))
    assert torch.equal(p["hidden_norm.weight"], torch.ones(128))
    H = 128
    fc = p["fc.weight"]
    assert torch.equal(fc[:, 2 * H :], torch.eye(H)) and not fc[:, : 2 * H].any()  # tap 4 is the deepest
    assert len(copied) == 2 * 11 + 2
    x = torch.randn(5, 3, H)  # the fused context starts as the deepest tap, normalised
    torch.testing.assert_close(d.fuse_context(x), d.hidden_norm(x[:, 2]))


@pytest.mark.parametrize("kv", [4, 1])
def test_gqa_kv_heads_are_repeated_or_averaged(kv):
    d, tcfg = drafter_for("qwen3", num_key_value_heads=kv)  # the target has 2 KV heads of 32
    init_from_target(d, tcfg)
    w = open_target_tensors(tcfg).get("model.layers.5.self_attn.k_proj.weight").unflatten(0, (2, 32))
    got = dict(d.named_parameters())["layers.1.self_attn.k_proj.weight"].detach().unflatten(0, (kv, 32))
    want = w.repeat_interleave(2, 0) if kv == 4 else w.mean(0, keepdim=True)
    torch.testing.assert_close(got, want)


def test_hybrid_target_uses_its_full_attention_layers_with_zero_centred_norms():
    d, tcfg = drafter_for("qwen3_5", layers=2, taps=(1, 6))
    init_from_target(d, tcfg)
    t = open_target_tensors(tcfg)
    p = dict(d.named_parameters())
    q = (
        t.get("model.layers.7.self_attn.q_proj.weight").unflatten(0, (4, 2, 64))[:, 0].flatten(0, 1)
    )  # gate dropped
    assert torch.equal(p["layers.1.self_attn.q_proj.weight"], q)
    assert torch.equal(p["layers.0.self_attn.o_proj.weight"], t.get("model.layers.3.self_attn.o_proj.weight"))
    torch.testing.assert_close(
        p["layers.1.input_layernorm.weight"], 1 + t.get("model.layers.7.input_layernorm.weight")
    )


@pytest.mark.parametrize(
    "change,needle",
    [
        (
            dict(num_attention_heads=8, head_dim=16),
            "set drafter.num_attention_heads = 4 and drafter.head_dim = 32",
        ),
        (dict(intermediate_size=100), "set drafter.intermediate_size"),
        (dict(num_key_value_heads=4, num_attention_heads=4, layers=7), "the target has 6 attention layers"),
    ],
)
def test_shapes_that_cannot_match_are_refused(change, needle):
    layers = change.pop("layers", 2)
    d, tcfg = drafter_for("qwen3", layers=layers, **change)
    with pytest.raises(DflashError, match="drafter.init = 'target_top'") as e:
        init_from_target(d, tcfg)
    assert needle in str(e.value)


def test_auto_copies_where_the_layers_fit_and_keeps_random_weights_where_not(capsys):
    from dflash_staged.train.trained_drafter import init_from_target_layers

    d, tcfg = drafter_for("qwen3", layers=2, taps=(1, 3, 4))
    cfg = Config(target=tcfg)
    assert cfg.drafter.init == "auto"  # the default for new runs
    out = init_from_target_layers(cfg, d, fresh=lambda: pytest.fail("the layers fit"))
    assert out is d and torch.equal(
        dict(d.named_parameters())["layers.1.mlp.up_proj.weight"],
        open_target_tensors(tcfg).get("model.layers.5.mlp.up_proj.weight"),
    )
    assert "drafter initialised from the target" in capsys.readouterr().err
    bad, _ = drafter_for("qwen3", layers=2, intermediate_size=100)
    fresh, _ = drafter_for("qwen3", layers=2, intermediate_size=100)
    assert init_from_target_layers(cfg, bad, fresh=lambda: fresh) is fresh
    assert "drafter.init = 'auto': random weights" in capsys.readouterr().err
    cfg.drafter.init = "target_top"  # asked for explicitly: refused, naming the fix
    with pytest.raises(DflashError, match="set drafter.intermediate_size"):
        init_from_target_layers(
            cfg, drafter_for("qwen3", layers=2, intermediate_size=100)[0], fresh=lambda: None
        )
