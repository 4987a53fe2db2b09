"""vLLM's drafter loaders for DFlash, DFlash2 and DSpark, replayed from its source (no vLLM import).

Taken from vLLM **v0.33.0**: the PyPI source distribution ``vllm-0.33.0.tar.gz`` (sha256
``f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112``), whose ``vllm/_version.py`` records
commit ``4ba787ec9`` (``g4ba787ec9``). Files, under ``vllm/``:

* ``model_executor/models/registry.py``: ``DFlashDraftModel -> qwen3_dflash.DFlashQwen3ForCausalLM``,
  ``DFlash2DraftModel -> qwen3_dflash2.DFlash2Qwen3ForCausalLM``, ``Qwen3DSparkModel ->
  qwen3_dspark.Qwen3DSparkForCausalLM``; nothing for ``DSpineDraftModel``.
* ``config/speculative.py``: ``method`` given, else ``dflash`` when the draft path contains "dflash", else
  ``dspark`` when it contains "dspark" or the architecture is ``Qwen3DSparkModel``, else ``draft_model``
  (an independent draft LM); ``num_speculative_tokens`` is required, except for DSpark (``block_size``).
* ``transformers_utils/configs/eagle.py``: under ``dflash`` an architecture not starting or ending with
  "DFlash" is renamed ``DFlash{arch}``.
* ``model_executor/models/qwen3_dflash.py``: ``_resolve_layer_attention`` (``layer_types``;
  ``dflash_config.swa_window_size`` else ``sliding_window``; ``is_causal``, else ``dflash_config.causal``,
  else sliding = causal; mixed sliding/full layers need the V2 model runner), ``fc`` of width
  ``(target_hidden_size or hidden_size) * len(aux layers)``, ``LogitsProcessor(scale=logit_scale)``
  (top-level ``logit_scale``, no softcap), ``load_weights`` (``model.`` prefix but for ``lm_head``; ``d2t``
  renamed, ``t2d`` dropped; ``embed_tokens``/``mask_embedding`` dropped when absent; the target's embedding
  and head shared afterwards) and ``hf_to_vllm_mapper`` (stacked ``.q_proj``... substrings).
* ``model_executor/models/qwen3_dflash2.py``: ``dflash_config.{conv_kernel_size, conv_group_size,
  selector_rank, selector_top_k, input_embedding_scale, output_multiplier, final_logit_softcapping}``; the
  convolutions' block is ``1 + num_speculative_tokens``; candidates through ``get_top_k_tokens``.
* ``model_executor/models/qwen3_dspark.py``: top-level ``markov_rank``, ``enable_confidence_head``,
  ``confidence_head_with_markov`` (default false), ``draft_vocab_size``; a vanilla Markov head only
  (``markov_head_type`` is not read); the Markov bias goes through the same ``LogitsProcessor``.
* ``model_executor/models/utils.py``: ``AutoWeightsLoader`` raises on a name with no parameter, except one
  ending in ``.bias``; ``WeightsMapper`` applies stacked substrings anywhere in a name.
* ``model_executor/layers/logits_processor.py``: ``forward`` caps then scales, ``get_top_k_tokens`` (DFlash2's
  candidates) scales then caps.
* ``v1/worker/gpu/spec_decode/dspark/speculator.py`` (``sample_from_anchor``: ``num_speculative_tokens``
  rows, each a proposal) and ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` (aux layers:
  ``eagle_aux_hidden_state_layer_ids``, else ``dflash_config.target_layer_ids`` + 1, else top-level
  ``target_layer_ids`` + 1).
"""

from __future__ import annotations

from engines.common import (
    STACKED,
    Load,
    Param,
    Refused,
    attention_layers,
    backbone,
    conv_params,
    dims,
    selector_params,
    transform,
)

ENGINE = "vLLM 0.33.0"
REGISTRY = {
    "DFlashDraftModel": "DFlashQwen3ForCausalLM",
    "DFlash2DraftModel": "DFlash2Qwen3ForCausalLM",
    "Qwen3DSparkModel": "Qwen3DSparkForCausalLM",
}


def method_of(c: dict, path: str, given: str | None) -> str:
    if given is not None:
        return given
    archs = c.get("architectures") or []
    if "dflash" in path.lower():
        return "dflash"
    if "dspark" in path.lower() or "Qwen3DSparkModel" in archs:
        return "dspark"
    return "draft_model"


def architecture(c: dict, method: str) -> str:
    arch = (c.get("architectures") or [""])[0]
    if method == "dflash" and not (arch.startswith("DFlash") or arch.endswith("DFlash")):
        arch = f"DFlash{arch}"
    if method == "dspark" and arch == "DSparkDraftModel" and c.get("model_type") == "qwen3":
        arch = "Qwen3DSparkModel"
    if method not in ("dflash", "dspark"):
        raise Refused(f"{ENGINE}: method {method!r} runs {arch} as an independent draft model, not a drafter")
    if arch not in REGISTRY:
        raise Refused(f"{ENGINE}: model architectures [{arch!r}] are not supported")
    return arch


def aux_layers(c: dict) -> list[int]:
    ids = c.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = [i + 1 for i in ((c.get("dflash_config") or {}).get("target_layer_ids") or [])]
    if not ids:
        ids = [i + 1 for i in (c.get("target_layer_ids") or [])]
    return list(ids)


def load(
    c: dict,
    shapes: dict[str, tuple[int, ...]],
    *,
    path: str = "drafter",
    method: str | None = None,
    num_speculative_tokens: int | None = None,
    v2_runner: bool = True,
) -> Load:
    """Replay ``--speculative-config '{"model": path, "method": ..., "num_speculative_tokens": ...}'`` on a
    checkpoint with ``config.json`` ``c`` and tensors ``shapes`` (name -> shape); raises :class:`Refused`
    where vLLM raises."""
    meth = method_of(c, path, method)
    arch = architecture(c, meth)
    dfl = c.get("dflash_config") or {}
    k = num_speculative_tokens
    if k is None and meth == "dspark":
        k = c.get("block_size") or c.get("dspark_block_size")
    if k is None:
        raise Refused(f"{ENGINE}: a speculative model was provided, but num_speculative_tokens was not")
    H, _, _, _, _, _, V = dims(c)
    types = c.get("layer_types") or []
    if 0 < types.count("sliding_attention") < len(types) and not v2_runner:
        raise Refused(f"{ENGINE}: mixed sliding/full attention requires the V2 model runner")

    def window() -> int:
        w = dfl.get("swa_window_size", c.get("sliding_window"))
        if w is None:
            raise Refused(f"{ENGINE}: DFlash sliding attention requires a window size")
        return int(w)

    causal = c.get("is_causal", dfl.get("causal"))
    layers = attention_layers({**c, "is_causal": causal}, window)
    fc_in = int(c.get("target_hidden_size") or H) * len(aux_layers(c))
    params = backbone(c, fc_in, "model.")
    draft_vocab = int(c.get("draft_vocab_size") or V)
    params.update(
        {
            "model.embed_tokens.weight": Param((V, H)),
            "model.mask_embedding": Param((H,)),
            "lm_head.weight": Param((draft_vocab, H)),
        }
    )
    if draft_vocab != V:  # a draft vocabulary: its own head and the draft-to-target offsets
        params["draft_id_to_target_id"] = Param((draft_vocab,))
    scale = float(c.get("logit_scale", 1.0))
    view = {
        "block": k + 1 if arch != "Qwen3DSparkModel" else k,
        "layers": layers,
        "fc_in": fc_in,
        "embed_scale": 1.0,
        "greedy_only": False,
        "logits": lambda raw, bias=None: raw * scale,
        "markov": None,
        "confidence": False,
    }
    out = Load(ENGINE, REGISTRY[arch], params, view)
    out.shared = {"model.embed_tokens.weight", "lm_head.weight"}
    out.unused = {"model.mask_embedding"}
    if arch == "DFlash2DraftModel":
        taps, group = int(dfl["conv_kernel_size"]), int(dfl["conv_group_size"])
        if H % group:
            raise Refused(f"{ENGINE}: conv_group_size={group} must divide hidden_size={H}")
        params.update(conv_params(c, "model.", taps, group))
        params.update(selector_params(c, "model.", int(dfl["selector_rank"])))
        m, cap = float(dfl.get("output_multiplier", 1.0)), float(dfl.get("final_logit_softcapping") or 0)
        view.update(
            conv_block=1 + k,
            top_k=int(dfl["selector_top_k"]),
            embed_scale=float(dfl.get("input_embedding_scale", 1.0)),
            logits=lambda raw, bias=None: transform(raw, m, cap or None, "scale_first"),
        )
    if arch == "Qwen3DSparkModel":
        if "markov_rank" not in c:
            raise Refused(f"{ENGINE}: 'Qwen3Config' object has no attribute 'markov_rank'")
        r = int(c["markov_rank"])
        params["model.markov_head.markov_w1.weight"] = Param((V, r))
        params["model.markov_head.markov_w2.weight"] = Param((draft_vocab, r))
        view.update(  # markov_rank 0: a zero-width head, whose bias is 0
            markov="vanilla" if r else None,
            logits=lambda raw, bias=None: (raw if bias is None else raw + bias) * scale,
        )
        has_conf = any("confidence_head" in n for n in shapes)
        if c.get("enable_confidence_head", False) and has_conf:
            width = H + (r if c.get("confidence_head_with_markov", False) else 0)
            params["model.confidence_head.proj.weight"] = Param((1, width))
            params["model.confidence_head.proj.bias"] = Param((1,))
            view["confidence"] = True
    _load_weights(out, shapes, dsp=arch == "Qwen3DSparkModel")
    return out


def _load_weights(out: Load, shapes: dict, dsp: bool) -> None:
    """``DFlashQwen3ForCausalLM.load_weights`` / ``Qwen3DSparkForCausalLM.load_weights`` and the mappers."""
    has = {n: any(n in k for k in shapes) for n in ("embed_tokens", "lm_head", "d2t")}
    drop = ["mask_embedding"] + [n for n in ("embed_tokens",) if not has[n]]
    if dsp:
        drop += [n for n in ("lm_head",) if not has[n]]
        if "model.confidence_head.proj.weight" not in out.params:
            drop.append("confidence_head")
    for key, shape in shapes.items():
        if "t2d" in key:
            out.ignored[key] = "t2d is training-only"
            continue
        name = key.replace("d2t", "draft_id_to_target_id") if "d2t" in key else key
        if "d2t" not in key and "lm_head" not in key:
            name = "model." + key
        if any(d in name for d in drop):
            out.ignored[key] = "dropped by the loader's mapper"
            continue
        shard = None
        for old, (new, sid) in STACKED.items():
            if f".{old}" in name:
                name, shard = name.replace(f".{old}", f".{new}", 1), sid
        if name not in out.params:
            if name.endswith(".bias"):
                out.ignored[key] = "an unexpected .bias is ignored"
                continue
            raise Refused(f"{ENGINE}: there is no module or parameter named {name!r}")
        out.route(key, shape, name, shard)
