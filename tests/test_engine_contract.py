"""Checkpoints this project saves, against vLLM's and SGLang's drafter loaders (replayed in
``tests/engines/``, from their published source), and the save-time lines of
:mod:`dflash_staged.model.drafters.engines`.

For every family and option: a tiny drafter saved with :func:`save_drafter`; each engine's replay reads its
``config.json`` and loads its tensors. Where it serves it, every tensor reaches an engine parameter of its
shape and every engine parameter is loaded but the target's shared embedding and head; the numbers the
engine's forward uses (input embedding scale, draft logits with the Markov bias, per-layer window and
causality, the block) are compared with the drafter's. An engine that refuses the file, or would draft
other numbers, must be named by :func:`serving_problems`, and one that serves it as trained must not."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
from dflash_staged.model.drafters.engines import (
    DEEPSPEC_EMBED,
    DEEPSPEC_HEAD,
    check_servable,
    serving_problems,
    with_target_embeddings,
)
from dflash_staged.model.drafters.weights import save_drafter
from dflash_staged.model.target.logits import transform_logits

from engines import sglang, vllm
from engines.common import Refused

SL, FU = "sliding_attention", "full_attention"
B = 4
D2 = dict(conv_group_size=8, selector_rank=8, selector_top_k=4)
SPARK = dict(markov_rank=8, markov_head_type="vanilla")
CASES = {  # name -> (DraftModelConfig fields, vLLM outcome, SGLang outcome)
    "dflash": ({}, "ok", "ok"),
    "dflash-sliding": (dict(layer_types=[SL, FU], sliding_window=3), "ok", "ok"),
    "dflash-causal": (dict(is_causal=True), "ok", "ok"),
    "dflash-multiplier": (dict(output_multiplier=0.5), "ok", "ok"),
    "dflash-softcap": (dict(output_multiplier=0.5, final_logit_softcapping=3.0), "misserved", "ok"),
    "dflash-embed-scale": (dict(input_embedding_scale=2.0), "misserved", "misserved"),
    "dflash2": (dict(architecture="dflash2", **D2), "ok", "ok"),
    "dflash2-sliding": (
        dict(architecture="dflash2", **D2, layer_types=[SL, SL], sliding_window=3),
        "ok",
        "ok",
    ),
    "dflash2-transform": (
        dict(architecture="dflash2", **D2, output_multiplier=0.5, final_logit_softcapping=3.0),
        "ok",
        "ok",
    ),
    "dflash2-embed-scale": (dict(architecture="dflash2", **D2, input_embedding_scale=2.0), "ok", "misserved"),
    "dspark": (dict(architecture="dspark", options=SPARK), "ok", "ok"),
    "dspark-no-confidence": (
        dict(architecture="dspark", options={**SPARK, "confidence_head": False}),
        "ok",
        "ok",
    ),
    "dspark-confidence-hidden": (
        dict(architecture="dspark", options={**SPARK, "confidence_head_with_markov": False}),
        "ok",
        "ok",
    ),
    "dspark-gated": (
        dict(architecture="dspark", options={**SPARK, "markov_head_type": "gated"}),
        "refused",
        "ok",
    ),
    "dspark-rnn": (
        dict(architecture="dspark", options={**SPARK, "markov_head_type": "rnn"}),
        "refused",
        "ok",
    ),
    "dspark-rank0": (
        dict(architecture="dspark", options={"markov_rank": 0, "confidence_head_with_markov": False}),
        "ok",
        "refused",
    ),
    "dspark-multiplier": (
        dict(architecture="dspark", options=SPARK, output_multiplier=0.5),
        "misserved",
        "misserved",
    ),
    "dspark-softcap": (
        dict(architecture="dspark", options=SPARK, final_logit_softcapping=3.0),
        "misserved",
        "misserved",
    ),
    "dspark-embed-scale": (
        dict(architecture="dspark", options=SPARK, input_embedding_scale=2.0),
        "misserved",
        "misserved",
    ),
    "dflash-vocab": (dict(draft_vocab_size=16), "ok", "misserved"),
    "dspark-vocab": (dict(architecture="dspark", options=SPARK, draft_vocab_size=16), "ok", "refused"),
    "dspine": (
        dict(architecture="dspine", options={"transfer_rank": 8, "message_size": 8, "top_k": 4}),
        "refused",
        "refused",
    ),
}
CONDITIONAL = {("dspark-no-confidence", sglang.ENGINE)}  # a line for a non-default engine setting


def tiny(**fields) -> DFlashDrafter:
    """A float32 drafter: hidden 32, 2 layers, 4/2 heads, vocabulary 64, block B, 2 target taps."""
    dcfg = DraftModelConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        block_size=B,
        num_target_layers=6,
        target_layer_ids=[1, 4],
        mask_token_id=63,
        dtype="float32",
        **fields,
    )
    g = torch.Generator().manual_seed(0)
    return DFlashDrafter(dcfg, torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (dcfg, config.json, {tensor: shape}) for every case, saved once."""
    out = {}
    for name, (fields, _, _) in CASES.items():
        d = save_drafter(tiny(**fields), tmp_path_factory.mktemp(name) / "ckpt")
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        out[name] = (
            DraftModelConfig.from_json((d / "config.json").read_text()),
            json.loads((d / "config.json").read_text()),
            shapes,
        )
    return out


def replay(engine, dcfg, c, shapes, **kw):
    if engine is vllm:
        return vllm.load(
            c,
            shapes,
            method=kw.pop("method", "dflash" if dcfg.family.name != "dspark" else None),
            num_speculative_tokens=kw.pop("k", dcfg.family.proposals(dcfg.block_size)),
            **kw,
        )
    return sglang.load(c, shapes, algorithm="DSPARK" if dcfg.family.name == "dspark" else "DFLASH", **kw)


def mismatches(load, dcfg) -> list[str]:
    """What the engine's forward would compute otherwise than the drafter was trained to."""
    v, out = load.view, []
    if v["embed_scale"] != dcfg.input_embedding_scale:
        out.append(f"input embeddings x {v['embed_scale']} (trained x {dcfg.input_embedding_scale})")
    g = torch.Generator().manual_seed(1)
    raw, bias = torch.randn(8, 64, generator=g) * 8, torch.randn(8, 64, generator=g) * 2
    ours = transform_logits(raw, dcfg.output_multiplier, dcfg.final_logit_softcapping)
    theirs = v["logits"](raw, bias if v["markov"] else None)
    if v["markov"]:
        ours = ours + bias
    same = (
        torch.equal(ours.argmax(-1), theirs.argmax(-1)) if v["greedy_only"] else torch.allclose(ours, theirs)
    )
    if not same:
        out.append("draft logits")
    layers = [
        (dcfg.sliding_window if t == SL else 0, dcfg.layer_causal(i)) for i, t in enumerate(dcfg.layer_types)
    ]
    if v["layers"] != layers:
        out.append(f"attention {v['layers']} (trained {layers})")
    if v["block"] != B or v.get("conv_block", B) != B:
        out.append(f"block {v['block']} / convolutions {v.get('conv_block')}")
    if v["fc_in"] != len(dcfg.target_layer_ids) * dcfg.hidden_size:
        out.append("fc width")
    if v["markov"] != (dcfg.options["markov_head_type"] if dcfg.options.get("markov_rank") else None):
        out.append(f"Markov head {v['markov']}")
    return out


_VLLM = importlib.util.find_spec("vllm")
REAL_VLLM = _VLLM is not None and _VLLM.origin is not None  # a namespace package "vllm" is not vLLM


@pytest.mark.parametrize("engine", [vllm, sglang], ids=["vllm", "sglang"])
@pytest.mark.parametrize("name", list(CASES))
def test_each_engine_loads_what_it_claims_and_the_save_lines_name_the_rest(saved, name, engine):
    if engine is vllm and REAL_VLLM:
        pytest.skip("vLLM is installed: tests/with_vllm/test_vllm_loaders.py loads through its real classes")
    dcfg, c, shapes = saved[name]
    want = CASES[name][1 if engine is vllm else 2]
    try:
        load = replay(engine, dcfg, c, shapes)
    except Refused as e:
        outcome, why = "refused", str(e)
    else:
        assert set(load.routes) | set(load.ignored) == set(shapes)
        assert load.unloaded() == set(), load.unloaded()
        assert load.shared <= {"model.embed_tokens.weight", "lm_head.weight"}
        why = mismatches(load, dcfg)
        # (beyond SGLang's static mode's confidence head: trained weights left out draft other numbers)
        why += [f"ignores {k}" for k in load.ignored if "confidence_head" not in k]
        outcome = "misserved" if why else "ok"
    assert outcome == want, why
    named = [line for line in serving_problems(dcfg) if engine.ENGINE in line.split(": ", 1)[0]]
    assert bool(named) == (outcome != "ok" or (name, engine.ENGINE) in CONDITIONAL), (outcome, named)


def test_plain_drafters_get_no_lines_and_dspark_only_deepspec_s(saved):
    for name in (
        "dflash",
        "dflash-sliding",
        "dflash-causal",
        "dflash-multiplier",
        "dflash2",
        "dflash2-transform",
    ):
        assert serving_problems(saved[name][0]) == [], name
    (line,) = serving_problems(saved["dspark"][0])
    assert "DeepSpec" in line and "with_target_embeddings" in line and "random" in line


def test_lines_a_to_d_name_the_engines(saved):
    def lines(name, *words):
        return [x for x in serving_problems(saved[name][0]) if all(w in x for w in words)]

    for kind in ("gated", "rnn"):  # (a)
        assert lines(f"dspark-{kind}", vllm.ENGINE, "vanilla", "llama.cpp", repr(kind))
    assert lines("dspark-rank0", sglang.ENGINE, "markov_rank = 0")  # (b)
    assert lines("dflash-softcap", vllm.ENGINE, "final_logit_softcapping")  # (c)
    assert lines("dflash-embed-scale", vllm.ENGINE, sglang.ENGINE, "input_embedding_scale")
    assert lines("dflash2-embed-scale", sglang.ENGINE, "input_embedding_scale")
    assert not lines("dflash2-embed-scale", vllm.ENGINE)
    for name in ("dspark-multiplier", "dspark-softcap"):
        assert lines(name, vllm.ENGINE, sglang.ENGINE, "llama.cpp", "Markov bias")
    for name in [n for n in CASES if n.startswith("dspark")]:  # (d)
        assert lines(name, "DeepSpec", "random")
    assert lines("dspine", vllm.ENGINE, sglang.ENGINE, "DSpineDraftModel")


def test_logit_scale_is_written_where_vllm_reads_it_and_round_trips(saved):
    for name, scale in (("dflash-multiplier", 0.5), ("dflash2-transform", 0.5), ("dflash", None)):
        dcfg, c, _ = saved[name]
        assert c.get("logit_scale") == scale
        assert DraftModelConfig.from_dict(c).to_dict() == c and DraftModelConfig.from_dict(c) == dcfg
    assert "logit_scale" not in saved["dspark-multiplier"][1]  # vLLM would scale the Markov bias with it


def test_only_what_every_engine_mis_serves_is_refused(saved):
    for name in ("dspark-multiplier", "dspark-softcap"):
        with pytest.raises(DflashError, match="no engine does"):
            check_servable(saved[name][0])
    for name in set(CASES) - {"dspark-multiplier", "dspark-softcap"}:
        assert check_servable(saved[name][0]) == serving_problems(saved[name][0])


def test_serving_settings_the_engines_need(saved):
    dcfg, c, shapes = saved["dflash"]
    with pytest.raises(Refused, match="independent draft model"):  # no method, no "dflash" in the path
        vllm.load(c, shapes, path="runs/x/step_100", num_speculative_tokens=B - 1)
    assert (
        vllm.load(c, shapes, path="runs/my-dflash/step_100", num_speculative_tokens=B - 1).view["block"] == B
    )
    with pytest.raises(Refused, match="num_speculative_tokens"):
        vllm.load(c, shapes, method="dflash")
    d2, c2, s2 = saved["dflash2"]
    assert vllm.load(c2, s2, method="dflash", num_speculative_tokens=B).view["conv_block"] == B + 1  # silent
    dsp, c3, s3 = saved["dspark"]
    assert vllm.load(c3, s3, path="runs/x").view["block"] == B  # detected by architecture; k = block_size
    assert sglang.load(c3, s3, algorithm="DSPARK").view["verify"] == B + 1
    with pytest.raises(Refused, match="gamma"):
        sglang.load(c3, s3, algorithm="DSPARK", num_draft_tokens=B)


def test_sglang_confidence_modes(saved):
    dcfg, c, shapes = saved["dspark"]
    full = sglang.load(c, shapes, algorithm="DSPARK", ragged_verify="compact")
    assert not full.ignored and full.unloaded() == set() and full.view["confidence"]
    off = saved["dspark-no-confidence"]
    with pytest.raises(Refused, match="missing"):
        sglang.load(off[1], off[2], algorithm="DSPARK", ragged_verify="compact")


def test_with_target_embeddings_writes_deepspec_s_names(tmp_path):
    from dflash_staged.config import TargetConfig, load_config
    from dflash_staged.model.target.tiny import MASK
    from dflash_staged.model.target.weights import load_embed_and_head

    cfg = load_config("configs/tiny.toml")
    cfg.drafter.dtype, cfg.drafter.architecture, cfg.drafter.num_hidden_layers = "float32", "dspark", 1
    cfg.drafter.options = dict(SPARK)
    embed, head = load_embed_and_head(TargetConfig(model="tiny:qwen3"))
    d = DFlashDrafter(DraftModelConfig.from_config(cfg, 128, 2048, 6, [1, 3], MASK), embed, head)
    src = save_drafter(d, tmp_path / "ckpt")
    out = with_target_embeddings(src, "tiny:qwen3", tmp_path / "deepspec")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(DEEPSPEC_EMBED), embed[:2048])
        assert torch.equal(f.get_tensor(DEEPSPEC_HEAD), head[:2048])
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    c = json.loads((out / "config.json").read_text())
    assert c == json.loads((src / "config.json").read_text())
    assert set(shapes) - set(d.state_dict()) == {DEEPSPEC_EMBED, DEEPSPEC_HEAD}
    loaded = vllm.load(c, shapes)
    assert loaded.routes["embed_tokens.weight"][0] == "model.embed_tokens.weight" and not loaded.unloaded()
    assert set(sglang.load(c, shapes, algorithm="DSPARK").ignored) == {DEEPSPEC_EMBED, DEEPSPEC_HEAD} | {
        k for k in shapes if k.startswith("confidence_head.")
    }
    with pytest.raises(DflashError, match="already holds"):
        with_target_embeddings(out, "tiny:qwen3", tmp_path / "again")


def test_write_drafter_prints_the_lines_once_a_run(capsys, tmp_path):
    from dflash_staged.config import TrainConfig
    from dflash_staged.train.trained_drafter import DrafterModel

    model = DrafterModel(tiny(architecture="dspark", options=SPARK), TrainConfig(), torch.device("cpu"), 0)
    for step in ("a", "b"):
        (tmp_path / step).mkdir()
        model.write_drafter(tmp_path / step)
    err = capsys.readouterr().err
    assert err.count("train: serving:") == 1 and "DeepSpec" in err
    with pytest.raises(DflashError, match="no engine does"):
        DrafterModel(
            tiny(architecture="dspark", options=SPARK, output_multiplier=0.5),
            TrainConfig(),
            torch.device("cpu"),
            0,
        )
