"""Tensor-parallel targets: one target split over the N processes of an extract worker group.

Contract (:func:`dflash_staged.model.target.load_target` with ``tp=N`` relies on it):

* The caller has made this process one rank of a ``torch.distributed`` world of exactly N
  processes, one per device (:mod:`dflash_staged.extract.group`); on CUDA, ``LOCAL_RANK`` is
  this process's CUDA device index (transformers binds that device).
* The target is loaded with transformers' tensor parallelism (``DistributedConfig(tp_plan="auto",
  tp_size=N)``, the model's own ``base_model_tp_plan``): each rank holds a 1/N slice of the
  attention, MLP and expert weights. A decoder layer's output (the residual stream the taps
  read) is a whole, replicated tensor on every rank, so :meth:`Target.capture` and its early stop
  work unchanged: every rank raises at the same layer, after the same collectives, and no rank
  is left waiting in one. Every rank must call ``capture`` with the same batch.
* :func:`check_tp` is the preflight: ``accelerate`` is installed (transformers needs it to
  place the slices), a TP plan exists and the attention and KV heads divide by N (a plan that
  splits KV heads unevenly loads fine and then fails in the first forward);
  :func:`check_sharded` refuses a model whose plan shards none of its decoder layers (every rank
  would hold the whole model, so TP buys no memory).

Architectures tried (transformers 5.24, torch 2.13, CPU with gloo, TP=2, tiny random models
built from a config in code; tapped layer outputs compared with a single-process model):

=================  ==============================================================================
qwen3              works, max difference 1.8e-7 (fp32). ``tiny:qwen3``
qwen3_moe          works, 8.9e-8; experts are split by columns (``moe_tp_experts``). ``tiny:qwen3_moe``
qwen3_5            works, 1.9e-7; linear-attention projections use ``colwise_gather_output`` (each
                   rank computes the whole Gated DeltaNet). ``tiny:qwen3_5``
qwen3_next         works, 1.8e-7 (hybrid + MoE). ``tiny:qwen3_next``
qwen3_5_moe        works, 9.3e-8 (the Qwen3.5/3.6 MoE family of the recipes)
llama, mixtral     work, 1.2e-7 and 1.0e-7
deepseek_v3        works, 6.3e-8 (MLA attention, shared + routed experts)
gpt_oss            runs and matches (needs eager attention), but its plan shards only the embedding
                   and the LM head: refused by :func:`check_sharded` (use expert parallelism elsewhere)
any, KV heads < N  loads, then the first forward fails (``shape [B, L, -1, D] is invalid``):
                   refused by :func:`check_tp`
=================  ==============================================================================
"""

from __future__ import annotations

import importlib.util

from dflash_staged.errors import DflashError
from dflash_staged.model.target.dims import text_config


def _heads(model_config) -> dict[str, int]:
    text = text_config(model_config)
    return {
        k: int(v) for k in ("num_attention_heads", "num_key_value_heads") if (v := getattr(text, k, None))
    }


def good_tp_sizes(model_config) -> list[int]:
    """TP sizes whose ranks each get a whole number of attention and KV heads."""
    heads = _heads(model_config)
    top = min(heads.values()) if heads else 1
    return [d for d in range(1, top + 1) if all(n % d == 0 for n in heads.values())]


def check_tp(model_config, tp: int, what: str = "the target") -> None:
    """Refuse a TP size this target cannot be split into; the message names the fix."""
    if tp <= 1:
        return
    if importlib.util.find_spec("accelerate") is None:
        raise DflashError(
            f"--tp {tp}: transformers' tensor-parallel loading needs the accelerate package; "
            "pip install accelerate"
        )
    text = text_config(model_config)
    kind = getattr(text, "model_type", type(text).__name__)
    if not (getattr(text, "base_model_tp_plan", None) or getattr(model_config, "base_model_tp_plan", None)):
        raise DflashError(
            f"--tp {tp}: transformers has no tensor-parallel plan for {what} ({kind}); run it with "
            "--tp 1 (one device per worker) or pick a target whose architecture has one"
        )
    heads = _heads(model_config)
    bad = {k: n for k, n in heads.items() if n % tp}
    if bad:
        names = {"num_attention_heads": "attention heads", "num_key_value_heads": "KV heads"}
        have = " and ".join(f"{n} {names[k]}" for k, n in heads.items())
        raise DflashError(
            f"--tp {tp}: {what} ({kind}) has {have}, which do not divide by {tp}; every rank needs "
            f"a whole number of heads. Use --tp {' or '.join(map(str, good_tp_sizes(model_config)))} "
            "(more extract workers of fewer devices each)"
        )


def tp_kwargs(tp: int) -> dict:
    """``from_pretrained`` keyword arguments for tensor parallelism over the current world of ``tp`` ranks."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before DistributedConfig: the older spelling
        return {"tp_plan": "auto", "tp_size": tp}
    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=tp)}


def shard_built_model(model, tp: int, dtype, attn_implementation: str):
    """A model built in code (a tiny target), reloaded from its own weights split over the ``tp`` ranks.

    Every rank builds the same weights (fixed seed), so no rank needs to read another's."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # else a "Loading weights" bar per rank, for a model already in memory
    return type(model).from_pretrained(
        None,
        config=model.config,
        state_dict=model.state_dict(),
        dtype=dtype,
        attn_implementation=attn_implementation,
        **tp_kwargs(tp),
    )


def check_sharded(model, layers, tp: int, what: str = "the target") -> None:
    """Refuse a TP-loaded model none of whose decoder-layer weights are split across the ranks."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in layers.parameters()):
        raise DflashError(
            f"--tp {tp}: transformers' tensor-parallel plan for {what} "
            f"({getattr(model.config, 'model_type', '?')}) splits none of its decoder layers, so "
            "every rank would hold the whole model; run it with --tp 1"
        )
