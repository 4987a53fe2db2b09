"""The GPU recipes load and validate on CPU; tokenizer checks run only where the model is local."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_staged.config import dflash_target_layers, load_config
from dflash_staged.launch.disk import disk_requirements
from dflash_staged.model.drafters.config import DraftModelConfig

ROOT = Path(__file__).resolve().parents[1]

# recipe -> (target layers, hidden, vocab, expected drafter geometry, mask id, hidden bytes per token: FP8,
# K x (H + 4), the recipes' store_dtype)
RECIPES = {
    "qwen3-8b.toml": (
        36,
        4096,
        151936,
        dict(
            num_hidden_layers=5,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=12288,
            rope_theta=1e6,
        ),
        151669,
        20_500,
    ),
    "qwen3.5-27b.toml": (
        64,
        5120,
        248320,
        dict(
            num_hidden_layers=5,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=17408,
            rope_theta=1e7,
        ),
        248070,
        25_620,
    ),
    "qwen3.6-35b-a3b.toml": (
        40,
        2048,
        248320,
        dict(
            num_hidden_layers=5,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=6144,
            rope_theta=1e7,
        ),
        248070,
        10_260,
    ),
    "qwen3.5-122b-a10b.toml": (
        48,
        3072,
        248320,
        dict(
            num_hidden_layers=5,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=9216,
            rope_theta=1e7,
        ),
        248070,
        15_380,
    ),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_loads_and_builds_the_drafter_config(name):
    layers, hidden, vocab, geometry, mask_id, hidden_bytes = RECIPES[name]
    cfg = load_config(ROOT / "configs" / name)
    ids = cfg.target.target_layer_ids
    assert ids == dflash_target_layers(layers, cfg.drafter.num_hidden_layers)  # explicit = the DFlash rule
    assert cfg.target.dtype == "auto"  # bf16 on CUDA
    assert cfg.drafter.mask_token_id == mask_id and mask_id < vocab  # a row of the target's embedding
    t = cfg.train
    assert 0 < t.gamma <= cfg.drafter.block_size and t.warmup_ratio < 0.2
    # anchors are positions of a sequence (blocks overlap): at most one per token
    assert cfg.data.max_len <= cfg.data.token_budget and t.num_anchors <= cfg.data.max_len
    d = DraftModelConfig.from_config(cfg, hidden, vocab, layers, ids, mask_id)
    assert {k: getattr(d, k) for k in geometry} == geometry
    assert len(d.target_layer_ids) * (hidden + 4) == hidden_bytes  # FP8: one byte a state, a float32 scale
    assert cfg.extract.store_dtype == "float8_e4m3fn"  # README "The store in FP8": tau within seed noise
    assert d.to_dict()["dflash_config"] == {
        "block_size": 16,
        "mask_token_id": mask_id,
        "target_layer_ids": ids,
    }


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_window_fits_its_trainer_and_disk_numbers(name):
    from dflash_staged.manifest.window import window_check

    cfg = load_config(ROOT / "configs" / name)
    err, warn = window_check(cfg, cfg.extract.window, workers=4, ranks=4)  # the 4 + 4 GPU layout of the docs
    assert err is None and warn is None
    layers, hidden, *_, hidden_bytes = RECIPES[name]
    d, lines = disk_requirements(ROOT / "configs" / name, 4, 8000, None, None, None)
    assert d["hidden"] == hidden and d["bytes_per_token"] == hidden_bytes + 5
    assert d["store_Bps"] == pytest.approx(2 * 8000 * 4 * (hidden_bytes + 5))
    if name == "qwen3-8b.toml":
        assert 1.2e9 < d["store_Bps"] < 1.6e9  # "Qwen3-8B on 4 target GPUs: roughly 1.5 GB/s" (FP8)


def _local_model(model: str) -> str | None:
    """A local directory or cached hub snapshot holding the tokenizer, else None (nothing is downloaded)."""
    if (Path(model) / "tokenizer_config.json").is_file():
        return model
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model, "tokenizer_config.json")
    except Exception:  # noqa: BLE001
        return None
    return str(Path(hit).parent) if isinstance(hit, str) else None


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_mask_token_against_the_tokenizer(name):
    cfg = load_config(ROOT / "configs" / name)
    local = _local_model(cfg.target.model)
    if local is None:
        pytest.skip(f"{cfg.target.model} is not on local disk")
    from transformers import AutoTokenizer

    from dflash_staged.model.drafters.weights import validate_mask_token

    tok = AutoTokenizer.from_pretrained(local)
    vocab = RECIPES[name][2]
    assert validate_mask_token(cfg.drafter.mask_token_id, tok, vocab) == cfg.drafter.mask_token_id
    assert cfg.drafter.mask_token_id >= len(tok)  # an unused embedding row: the data can never contain it


# The MoE recipes' targets, from their public configs (nothing is downloaded): the text config of
# Qwen3.5/3.6 MoE, and the --tp each recipe's comment gives (with the one the preflight must refuse).
PUBLIC_MOE = {
    "qwen3.6-35b-a3b.toml": (
        dict(
            hidden_size=2048,
            num_hidden_layers=40,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
        ),
        2,
        4,
    ),
    "qwen3.5-122b-a10b.toml": (
        dict(
            hidden_size=3072,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=2,
            head_dim=256,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024,
        ),
        2,
        4,
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLIC_MOE))
def test_moe_recipe_taps_and_tp_against_the_public_geometry(name):
    from transformers import Qwen3_5MoeTextConfig

    from dflash_staged.errors import DflashError
    from dflash_staged.model.target.parallel import check_tp

    geometry, tp, too_many = PUBLIC_MOE[name]
    text = Qwen3_5MoeTextConfig(vocab_size=248320, **geometry)
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.target.target_layer_ids == dflash_target_layers(
        text.num_hidden_layers, cfg.drafter.num_hidden_layers
    )
    assert text.layer_types.count("full_attention") == text.num_hidden_layers // 4  # 3 DeltaNet : 1 attention
    assert f"--tp {tp}" in (ROOT / "configs" / name).read_text()
    check_tp(text, tp)
    with pytest.raises(DflashError, match=f"--tp {too_many}: .* 2 KV heads"):
        check_tp(text, too_many)
    d, _ = disk_requirements(ROOT / "configs" / name, 4, 3000, None, None, None, tp=tp)
    assert d["extract_workers"] == 4 // tp and d["bytes_per_token"] == RECIPES[name][5] + 5


# DFlash2 recipe -> its DFlash twin (same target, data and extract settings: the same stored shards)
DFLASH2 = {"qwen3-8b-dflash2.toml": "qwen3-8b.toml", "qwen3.5-27b-dflash2.toml": "qwen3.5-27b.toml"}


@pytest.mark.parametrize("name", sorted(DFLASH2))
def test_dflash2_recipe_has_the_released_architecture_and_fits_an_80gb_gpu(name):
    import torch

    from dflash_staged.model.drafters.backbone import DFlashDrafter
    from dflash_staged.train.memory import estimate, row_budget

    twin = DFLASH2[name]
    cfg, base = load_config(ROOT / "configs" / name), load_config(ROOT / "configs" / twin)
    assert (cfg.target, cfg.data, cfg.extract) == (base.target, base.data, base.extract)
    layers, hidden, vocab, geometry, mask_id, _ = RECIPES[twin]
    ids = cfg.target.target_layer_ids
    d = DraftModelConfig.from_config(cfg, hidden, vocab, layers, ids, mask_id)
    out = d.to_dict()
    assert out["architectures"] == ["DFlash2DraftModel"] and out["is_causal"] is False
    assert out["layer_types"] == ["sliding_attention"] * 5 and out["sliding_window"] == 2048
    assert out["dflash_config"] == {
        "block_size": 8,
        "mask_token_id": mask_id,
        "target_layer_ids": ids,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 256,
        "selector_top_k": 16,
    }
    assert {k: getattr(d, k) for k in geometry} == geometry
    assert (cfg.train.lr, cfg.train.gamma, cfg.train.num_anchors, cfg.train.selector_alpha) == (
        5e-4,
        7.0,
        512,
        1.0,
    )
    with torch.device("meta"):
        drafter = DFlashDrafter(d, torch.empty(vocab, hidden), torch.empty(vocab, hidden))
    est = estimate(drafter, cfg.train, torch.device("cuda"), device_bytes=80 * 2**30)
    assert row_budget(est, cfg.train, 8) >= cfg.train.num_anchors * 8


@pytest.mark.parametrize(
    "name,arch,block",
    [("qwen3-8b-dspark.toml", "Qwen3DSparkModel", 7), ("qwen3-8b-dspine.toml", "DSpineDraftModel", 16)],
)
def test_dspark_and_dspine_recipes_store_the_topk_and_fit_an_80gb_gpu(name, arch, block):
    import dataclasses

    import torch

    from dflash_staged.model.drafters.backbone import DFlashDrafter
    from dflash_staged.train.memory import estimate, row_budget

    cfg, base = load_config(ROOT / "configs" / name), load_config(ROOT / "configs" / "qwen3-8b.toml")
    assert cfg.target.store_topk == 64 and not cfg.target.store_last_layer  # (issue 48: not the FP8 layer)
    assert dataclasses.replace(cfg.target, store_topk=0) == base.target
    assert (cfg.data, cfg.extract.window) == (base.data, base.extract.window)
    layers, hidden, vocab, geometry, mask_id, _ = RECIPES["qwen3-8b.toml"]
    d = DraftModelConfig.from_config(cfg, hidden, vocab, layers, cfg.target.target_layer_ids, mask_id)
    out = d.to_dict()
    assert out["architectures"] == [arch] and d.block_size == block
    assert {k: getattr(d, k) for k in geometry} == geometry
    with torch.device("meta"):
        drafter = DFlashDrafter(d, torch.empty(vocab, hidden), torch.empty(vocab, hidden))
    est = estimate(
        drafter, cfg.train, torch.device("cuda"), device_bytes=80 * 2**30, target_logits=True, topk=64
    )
    assert row_budget(est, cfg.train, block) >= cfg.train.num_anchors * block
    d_req, _ = disk_requirements(ROOT / "configs" / name, 4, 8000, None, None, None)
    assert d_req["bytes_per_token"] == 5 * (hidden + 4) + 64 * 6 + 4 + 5 == 20_893  # five taps in FP8, top-64
