"""SGLang's drafter loaders for DFlash, DFlash2 and DSpark, replayed from its source (no SGLang import).

Taken from SGLang **v0.5.23**: the PyPI wheel ``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``
(sha256 ``00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937``; its ``sglang/_version.py``
records no commit). Files, under ``python/sglang/srt/``:

* ``models/dflash.py``: ``EntryClass`` (``DFlashDraftModel``, ``DFlash2DraftModel``, ...; no DSpine),
  ``DFlashDraftModel.__init__`` (``fc`` of width ``len(target_layer_ids) * hidden_size``; the grouped
  convolutions when ``conv_kernel_size`` is set; no embedding or head of its own), the layer attention
  rule (``layer_types``; a top-level ``is_causal`` wins, else sliding = causal; the window is
  ``sliding_window - 1`` positions to the left), ``load_weights`` (stacked ``.q_proj.``... names, a
  ``model.`` prefix added or stripped, **an unknown name silently ignored**), ``DFlash2DraftModel``
  (``selector_rank`` required; its unary logits times ``output_multiplier``, then softcapped). Plain DFlash
  drafts greedily over the target's head (``speculative/dflash_worker_v2.py``, ``_DflashDraftSampler``).
* ``speculative/dflash_utils.py``: ``parse_dflash_draft_config`` (``dflash_config`` first, then top level:
  ``block_size``, ``num_target_layers``, ``target_layer_ids``, ``mask_token_id``; only from
  ``dflash_config``: ``conv_kernel_size``/``conv_group_size`` and ``selector_rank``/``selector_top_k`` in
  pairs, ``output_multiplier`` > 0, ``final_logit_softcapping``). ``input_embedding_scale`` is read nowhere.
* ``speculative/dspark_components/dspark_config.py``: ``parse_dspark_draft_config`` (``markov_rank`` and
  ``markov_head_type`` from ``dspark_config``/``dflash_config``, else the top level; the type required when
  the rank is > 0, one of vanilla/gated/rnn), ``resolve_runtime_config`` (``markov_rank > 0`` required;
  gamma = ``block_size``, verify window gamma + 1).
* ``models/dspark.py``: ``build_markov_head`` (rank > 0; ``gate_proj`` ``H + r -> r`` or ``joint_proj``
  ``2r + H -> 3r``, with biases), ``build_confidence_head`` (none in the default ``SGLANG_RAGGED_VERIFY_MODE
  = static``; otherwise built whatever ``enable_confidence_head`` says, input ``H (+ r)`` with
  ``confidence_head_with_markov`` defaulting to ``markov_rank > 0``), ``DSparkDraftMixin.load_weights``
  (``lm_head.``/``rotary_emb.``/``embed_tokens.`` skipped; an unknown Markov or confidence name raises; a
  built confidence head must be loaded whole), ``compute_base_logits`` (the raw target-head logits, to
  which the Markov bias is added).
* ``arg_groups/speculative_hook.py``: ``--speculative-algorithm DFLASH`` (``--speculative-num-draft-tokens``
  defaults to ``block_size``) or ``DSPARK`` (``--speculative-num-draft-tokens`` = gamma + 1).
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

ENGINE = "SGLang 0.5.23"
MODELS = {
    "DFLASH": ("DFlashDraftModel", "DFlash2DraftModel"),
    "DSPARK": ("Qwen3DSparkModel", "DSparkDraftModel"),
}
KINDS = ("vanilla", "gated", "rnn")


def _pair(dfl: dict, a: str, b: str) -> tuple[int, int]:
    x, y = int(dfl.get(a, 0)), int(dfl.get(b, 0))
    if bool(x) != bool(y):
        raise Refused(f"{ENGINE}: DFLASH needs {a} and {b} together")
    return x, y


def load(
    c: dict,
    shapes: dict[str, tuple[int, ...]],
    *,
    algorithm: str,
    num_draft_tokens: int | None = None,
    ragged_verify: str = "static",
) -> Load:
    """Replay ``--speculative-algorithm ALGORITHM --speculative-draft-model-path ...`` on a checkpoint with
    ``config.json`` ``c`` and tensors ``shapes``; raises :class:`Refused` where SGLang raises."""
    arch = (c.get("architectures") or [""])[0]
    if arch not in MODELS.get(algorithm, ()):
        raise Refused(f"{ENGINE}: {algorithm} cannot run model architecture {arch!r}")
    dfl = c.get("dflash_config") or {}
    H, _, _, _, _, _, V = dims(c)
    block = dfl.get("block_size", c.get("block_size"))
    taps, group = _pair(dfl, "conv_kernel_size", "conv_group_size")
    rank, top_k = _pair(dfl, "selector_rank", "selector_top_k")
    m = float(dfl.get("output_multiplier", 1.0))
    if m <= 0:
        raise Refused(f"{ENGINE}: DFLASH output_multiplier must be positive")
    cap = float(dfl.get("final_logit_softcapping") or 0.0) or None
    ids = dfl.get("target_layer_ids", c.get("target_layer_ids"))
    n_target = int(dfl.get("num_target_layers", c.get("num_target_layers")) or max(ids) + 1)
    if any(not 0 <= i < n_target for i in ids):
        raise Refused(f"{ENGINE}: DFLASH target_layer_ids contains an out-of-range layer id")

    def window() -> int:
        if c.get("sliding_window") is None:
            raise Refused(f"{ENGINE}: DFLASH sliding_attention layers require config.sliding_window")
        return int(c["sliding_window"])  # window_left = sliding_window - 1, the own position included

    params = backbone(c, len(ids) * H)
    if taps:
        if H % group:
            raise Refused(f"{ENGINE}: DFLASH conv_group_size={group} must divide hidden_size={H}")
        params.update(conv_params(c, "", taps, group))
    view = {
        "layers": attention_layers(c, window),
        "fc_in": len(ids) * H,
        "embed_scale": 1.0,
        "greedy_only": True,
        "logits": lambda raw, bias=None: raw,
        "markov": None,
        "confidence": False,
    }
    if algorithm == "DFLASH":
        view["block"] = int(num_draft_tokens or block or 16)
        view["conv_block"] = view["block"]
    if arch == "DFlash2DraftModel":
        if not rank:
            raise Refused(f"{ENGINE}: DFlash selector draft requires dflash_config.selector_rank")
        params.update(selector_params(c, "", rank))
        view.update(
            top_k=top_k,
            greedy_only=False,
            logits=lambda raw, bias=None: transform(raw, m, cap, "scale_first"),
        )
    out = Load(ENGINE, arch, params, view)
    if algorithm == "DSPARK":
        _dspark(out, c, dfl, block, num_draft_tokens, ragged_verify)
    _load_weights(out, shapes, dsp=algorithm == "DSPARK")
    return out


def _dspark(out: Load, c: dict, dfl: dict, block, num_draft_tokens, ragged_verify: str) -> None:
    """``parse_dspark_draft_config``, ``resolve_runtime_config``, ``build_markov_head``,
    ``build_confidence_head``."""
    H, V = int(c["hidden_size"]), int(c["vocab_size"])
    sub = {**dfl, **(c.get("dspark_config") or {})}
    r = int(sub.get("markov_rank", c.get("markov_rank", 0)) or 0)
    kind = sub.get("markov_head_type", c.get("markov_head_type"))
    if r > 0 and kind is None:
        raise Refused(f"{ENGINE}: DSpark requires markov_head_type when markov_rank > 0")
    if kind is not None and str(kind).lower() not in KINDS:
        raise Refused(f"{ENGINE}: unsupported DSpark markov_head_type={kind!r}")
    if r <= 0:
        raise Refused(f"{ENGINE}: DSpark draft requires markov_rank > 0, got markov_rank={r}")
    gamma = int(block)
    if num_draft_tokens is not None and int(num_draft_tokens) != gamma + 1:
        raise Refused(f"{ENGINE}: DSpark speculative_num_draft_tokens must equal gamma + 1")
    kind = str(kind).lower()
    p = "markov_head."
    out.params[p + "markov_w1.weight"] = Param((V, r))
    out.params[p + "markov_w2.weight"] = Param((V, r))
    if kind == "gated":
        out.params.update({p + "gate_proj.weight": Param((r, H + r)), p + "gate_proj.bias": Param((r,))})
    if kind == "rnn":
        out.params.update(
            {p + "joint_proj.weight": Param((3 * r, 2 * r + H)), p + "joint_proj.bias": Param((3 * r,))}
        )
    out.view.update(block=gamma, verify=gamma + 1, markov=kind, greedy_only=False)
    out.view["logits"] = lambda raw, bias=None: raw + bias
    if ragged_verify != "static":
        with_markov = bool(c.get("confidence_head_with_markov", r > 0))
        out.params["confidence_head.proj.weight"] = Param((1, H + (r if with_markov else 0)))
        out.params["confidence_head.proj.bias"] = Param((1,))
        out.view["confidence"] = True


def _resolve(params: dict, name: str) -> str | None:
    if name in params:
        return name
    other = name.removeprefix("model.") if name.startswith("model.") else f"model.{name}"
    return other if other in params else None


def _load_weights(out: Load, shapes: dict, dsp: bool) -> None:
    """``DSparkDraftMixin.load_weights`` (``dsp``) around ``DFlashDraftModel.load_weights``."""
    for key, shape in shapes.items():
        bare = key.removeprefix("model.")
        if key.startswith(("prefix_gru.", "embed_proj.")):
            raise Refused(f"{ENGINE}: DFLASH checkpoint contains Domino projector weights")
        if dsp and bare.startswith(("lm_head.", "rotary_emb.", "embed_tokens.")):
            out.ignored[key] = "skipped: the target's is attached after loading"
            continue
        if dsp and key.startswith(("confidence_head.", "markov_head.")):
            if key.startswith("confidence_head.") and "confidence_head.proj.weight" not in out.params:
                out.ignored[key] = "skipped: no confidence head (SGLANG_RAGGED_VERIFY_MODE=static)"
                continue
            if key not in out.params:
                raise Refused(f"{ENGINE}: DSpark unexpected weight {key!r} not found in model parameters")
            out.route(key, shape, key)
            continue
        for old, (new, sid) in STACKED.items():
            if f".{old}." in key and (name := _resolve(out.params, key.replace(old, new))) is not None:
                out.route(key, shape, name, sid)
                break
        else:
            name = _resolve(out.params, key)
            if name is None:
                out.ignored[key] = "unexpected: silently ignored by DFlashDraftModel.load_weights"
                continue
            out.route(key, shape, name)
    if dsp and "confidence_head.proj.weight" in out.params:
        missing = {n for n in out.params if n.startswith("confidence_head.")} - {
            r[0] for r in out.routes.values()
        }
        if missing:
            raise Refused(
                f"{ENGINE}: DSpark confidence head is enabled but the checkpoint is missing {sorted(missing)}"
            )
