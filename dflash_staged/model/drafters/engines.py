"""Which serving engines would refuse or mis-serve a drafter config, and a copy of a checkpoint for DeepSpec.

Contract (every fact below was read from the engines' published source; ``tests/engines/`` replays their
config reads and weight loaders and ``tests/test_engine_contract.py`` holds the two to each other):

* :func:`serving_problems` ``(dcfg) -> [line]``: one line for each engine (and version) that would refuse
  this drafter config, or load it and draft with other numbers than it was trained with. Empty for a
  plain DFlash or DFlash2 drafter. A draft vocabulary (``draft_vocab_size``): vLLM reads it for DFlash
  and DSpark; llama.cpp's converter only for DSpark; SGLang for neither.
  Engines: **vLLM 0.33.0** (``vllm/model_executor/models/qwen3_dflash.py``,
  ``qwen3_dflash2.py``, ``qwen3_dspark.py``), **SGLang 0.5.23** (``python/sglang/srt/models/dflash.py``,
  ``dspark.py``, ``speculative/dflash_utils.py``, ``speculative/dspark_components/dspark_config.py``),
  **llama.cpp** as vendored by llama-cpp-python 0.3.36 (``conversion/qwen.py``,
  ``src/models/dflash.cpp``) and **DeepSpec**'s evaluator (``deepspec/eval/dspark/evaluator.py``).
* Semantics compared: the draft logits ``transform(head(h))`` (``output_multiplier``, then the softcap),
  plus the Markov bias for DSpark (``transform(u) + bias``); and the block's input embeddings times
  ``input_embedding_scale``. A greedy-only draft path (SGLang's DFlash) is unaffected by a positive
  scale or a softcap, which keep the argmax.
* ``config.json`` carries a top-level ``logit_scale`` (= ``output_multiplier``) for DFlash and DFlash2:
  vLLM's ``DFlashQwen3ForCausalLM`` multiplies its draft logits by it (``LogitsProcessor(scale=)``), so
  that engine reads the multiplier; DSpark gets none, since vLLM's DSpark passes the Markov bias through
  the same scale (``logit_scale * (u + bias)``), which is not how it was trained.
* :func:`check_servable` refuses (``DflashError``) the one case every engine would silently mis-serve:
  a DSpark drafter with ``output_multiplier != 1`` or a softcap (vLLM scales the Markov bias too or not
  at all, SGLang and llama.cpp add it to the untransformed logits; all of them walk greedy Markov chains
  on other logits, without an error). Everything else trains: a drafter one engine cannot serve is still
  served by another, so the rest are warnings, returned for the trainer to print once a run.
* :func:`with_target_embeddings` writes a copy of a checkpoint with the target's embedding and LM head
  under the names DeepSpec's ``Qwen3DSparkModel`` loads (``embed_tokens.weight``, ``lm_head.weight``),
  atomically. vLLM and SGLang load that copy too (vLLM then uses the copies, SGLang skips them); this
  project's :func:`~dflash_staged.model.drafters.weights.load_drafter` does not (unexpected tensors).
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash_staged.errors import DflashError
from dflash_staged.fsutil import atomic_dir

VLLM = "vLLM 0.33.0"
SGLANG = "SGLang 0.5.23"
LLAMACPP = "llama.cpp (llama-cpp-python 0.3.36)"
DEEPSPEC = "DeepSpec's evaluator (deepspec/eval/dspark/evaluator.py)"
DEEPSPEC_EMBED, DEEPSPEC_HEAD = "embed_tokens.weight", "lm_head.weight"  # Qwen3DSparkModel's own names


def _transformed(dcfg) -> bool:
    return dcfg.output_multiplier != 1.0 or bool(dcfg.final_logit_softcapping)


def unservable(dcfg) -> str | None:
    """Why every engine would silently draft other numbers than this drafter was trained with (None: some
    engine serves it as trained, or refuses it loudly)."""
    if dcfg.family.name == "dspark" and _transformed(dcfg):
        return (
            f"a DSpark drafter with output_multiplier = {dcfg.output_multiplier:g} and "
            f"final_logit_softcapping = {dcfg.final_logit_softcapping or 0:g} adds its Markov bias to the "
            f"transformed logits, and no engine does: {VLLM} (qwen3_dspark.py) scales logits and bias alike "
            "by a top-level logit_scale and applies no softcap, "
            f"{SGLANG} (models/dspark.py) and {LLAMACPP} (src/models/dflash.cpp) add the bias to the raw "
            "logits; each walks its greedy Markov chain on other logits without an error. Train a dflash2 "
            "drafter for this target instead (vLLM, SGLang and llama.cpp apply its logit transform)"
        )
    return None


def check_servable(dcfg) -> list[str]:
    """:func:`serving_problems`, after refusing (``DflashError``) a config :func:`unservable` names."""
    why = unservable(dcfg)
    if why:
        raise DflashError(f"drafter.architecture = {dcfg.family.name!r}: {why}")
    return serving_problems(dcfg)


def _line(engines: list[str], why: str) -> str:
    """``"A, B and C: why"``: the engines named before the colon are the ones that refuse or mis-serve."""
    who = engines[0] if len(engines) == 1 else f"{', '.join(engines[:-1])} and {engines[-1]}"
    return f"{who}: {why}"


def serving_problems(dcfg) -> list[str]:
    """One line for each problem: the engines (and versions) that would refuse or mis-serve this drafter
    config, then why (see the module contract); empty for a drafter every engine serves as trained."""
    fam, out = dcfg.family.name, []
    if fam == "dspine":
        why = (
            "no DSpineDraftModel, so the checkpoint is refused (SpecForge's spec_generate needs a DSpine "
            "verifier integration); evaluate it with `dflash eval`"
        )
        return [_line([VLLM, SGLANG, LLAMACPP], why)]
    if dcfg.input_embedding_scale != 1.0:
        who = [VLLM, SGLANG] if fam != "dflash2" else [SGLANG]
        out.append(
            _line(
                who,
                f"input_embedding_scale = {dcfg.input_embedding_scale:g} is never read (vLLM: only "
                "qwen3_dflash2.py reads it; SGLang: models/dflash.py, models/dspark.py), so the block's "
                f"input embeddings go in unscaled and every draft differs from training ({LLAMACPP} applies "
                "it)",
            )
        )
    if fam == "dflash" and dcfg.final_logit_softcapping:
        why = (
            f"qwen3_dflash.py applies the top-level logit_scale but no final_logit_softcapping = "
            f"{dcfg.final_logit_softcapping:g}: drafts sampled at temperature > 0 follow uncapped logits "
            "(greedy drafts are unaffected; SGLang drafts greedily)"
        )
        out.append(_line([VLLM], why))
    if fam == "dflash" and dcfg.draft_vocab_size:
        why = (
            f"draft_vocab_size = {dcfg.draft_vocab_size}: its converter (conversion/qwen.py) writes a d2t "
            "table only for DSpark, so the DFlash checkpoint's d2t is refused; vLLM serves it"
        )
        out.append(_line([LLAMACPP], why))
        why = (
            "reads no draft_vocab_size: models/dflash.py silently ignores lm_head.weight and d2t and drafts "
            "with the target's head over the whole vocabulary, not the head it was trained with"
        )
        out.append(_line([SGLANG], why))
    if fam == "dspark":
        out += _dspark_problems(dcfg)
    return out


def _dspark_problems(dcfg) -> list[str]:
    o, out = dcfg.options, []
    if dcfg.draft_vocab_size and o["markov_rank"]:
        why = (
            f"refuses draft_vocab_size = {dcfg.draft_vocab_size}: models/dspark.py builds markov_w2 over the "
            "whole vocabulary and cannot load the checkpoint's (N x rank); vLLM and llama.cpp serve it"
        )
        out.append(_line([SGLANG], why))
    if (why := unservable(dcfg)) is not None:
        out.append(_line([VLLM, SGLANG, LLAMACPP], why))
    kind = o["markov_head_type"]
    if o["markov_rank"] and kind != "vanilla":
        extra = "gate_proj" if kind == "gated" else "joint_proj"
        why = (
            f"only the vanilla Markov head is built (vLLM's qwen3_dspark.py refuses a {kind!r} one at load: "
            f"no parameter takes markov_head.{extra}.weight) or converted (llama.cpp's conversion/qwen.py, "
            "DSparkModel); SGLang serves it"
        )
        out.append(_line([VLLM, LLAMACPP], why))
    if not o["markov_rank"]:
        why = (
            "refuses markov_rank = 0 (dspark_config.py and models/dspark.py: 'DSpark draft requires "
            "markov_rank > 0'); vLLM loads it with a zero-width Markov head"
        )
        out.append(_line([SGLANG], why))
    if not o["confidence_head"]:
        why = (
            "with SGLANG_RAGGED_VERIFY_MODE = cap-accept or compact it builds a confidence head whatever "
            "enable_confidence_head says, and refuses a checkpoint without its weights (models/dspark.py); "
            "the default (static) mode serves it"
        )
        out.append(_line([SGLANG], why))
    why = (
        "it loads the drafter with from_pretrained and never copies the target's embedding and LM head in; "
        "this checkpoint omits them (vLLM and SGLang take the target's), so there it drafts with random "
        "ones: give it a copy from dflash_staged.model.drafters.engines.with_target_embeddings"
    )
    out.append(_line([DEEPSPEC], why))
    return out


def with_target_embeddings(src: str | os.PathLike, target: str, out: str | os.PathLike) -> Path:
    """Write ``out``: checkpoint ``src`` plus the target's input embedding and LM head (``target``: a
    ``[target] model``, a directory, hub id or ``tiny:*``) as ``embed_tokens.weight`` and ``lm_head.weight``
    (the drafter's ``vocab_size`` rows, in the checkpoint's dtype), the names DeepSpec's class loads.
    Atomic: ``out`` appears complete or not at all (an existing one is replaced)."""
    from safetensors.torch import load_file, save_file

    from dflash_staged.config import TargetConfig
    from dflash_staged.dtypes import torch_dtype
    from dflash_staged.model.drafters.weights import (
        CONFIG_NAME,
        WEIGHTS_NAME,
        _weight_files,
        read_drafter_config,
    )
    from dflash_staged.model.target.weights import load_embed_and_head

    src = Path(src)
    dcfg = read_drafter_config(src)
    state = {}
    for f in _weight_files(src):
        state.update(load_file(str(f)))
    taken = sorted({DEEPSPEC_EMBED, DEEPSPEC_HEAD} & set(state))
    if taken:
        raise DflashError(f"{src}: already holds {', '.join(taken)}; nothing to add")
    embed, head = load_embed_and_head(TargetConfig(model=str(target)))
    V, H = dcfg.vocab_size, dcfg.hidden_size
    for name, w in (("embedding", embed), ("LM head", head)):
        if w.dim() != 2 or w.shape[0] < V or w.shape[1] != H:
            raise DflashError(
                f"target {target}: its {name} is {tuple(w.shape)}, the drafter {src} needs [>= {V}, {H}]: "
                "is this the target it was trained for?"
            )
    dt = torch_dtype(dcfg.dtype, "checkpoint dtype")
    state[DEEPSPEC_EMBED] = embed[:V].to(dt).clone()
    state[DEEPSPEC_HEAD] = head[:V].to(dt).clone()  # a tied target: two tensors
    with atomic_dir(Path(out), replace=True) as tmp:
        (tmp / CONFIG_NAME).write_text((src / CONFIG_NAME).read_text())
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        os.chmod(tmp, 0o755)
    return Path(out)
