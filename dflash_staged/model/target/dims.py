"""The target's dimensions, from its config alone (no weights loaded): the one place they are read.

:func:`target_text_config` returns the text model's transformers config of ``[target]`` (a
tiny target built in code, a local directory, a hub id, or a GGUF file);
:func:`target_dims` its layer count, hidden size and vocabulary size. Multimodal configs give
their text config (``get_text_config``).
"""

from __future__ import annotations

from typing import NamedTuple

from dflash_staged.config import TargetConfig
from dflash_staged.errors import DflashError


class TargetDims(NamedTuple):
    num_layers: int
    hidden_size: int
    vocab_size: int


def text_config(model_config):
    """The text part of a (possibly multimodal) transformers config."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def target_text_config(tcfg: TargetConfig, local_only: bool = False):
    """The target's text model config, without loading weights.

    ``local_only`` reads only local files and the hub cache (never the network).
    """
    if tcfg.model.startswith("tiny:"):
        from dflash_staged.model.target.tiny import KINDS, tiny_config

        kind = tcfg.model.split(":", 1)[1]
        if kind not in KINDS:
            raise DflashError(
                f"target.model={tcfg.model!r}: unknown tiny target; use one of "
                f"{', '.join('tiny:' + k for k in KINDS)}"
            )
        return tiny_config(kind)
    from transformers import AutoConfig

    kw = {"gguf_file": tcfg.gguf_file} if tcfg.gguf_file else {}
    try:
        mcfg = AutoConfig.from_pretrained(tcfg.model, local_files_only=local_only, **kw)
    except Exception as e:  # noqa: BLE001 - any load failure is a user-fixable path problem
        why = " ".join(str(e).split())  # one line: transformers' messages run over several
        raise DflashError(
            f"target.model={tcfg.model!r}: cannot read the model config ({type(e).__name__}: {why}); "
            "check the path or hub id (offline, the files must be local)"
        ) from None
    return text_config(mcfg)


def target_dims(tcfg: TargetConfig, local_only: bool = False) -> TargetDims:
    """(num_layers, hidden_size, vocab_size) of the target, from its config only."""
    c = target_text_config(tcfg, local_only)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if not getattr(c, k, None)]
    if missing:
        raise DflashError(
            f"target.model={tcfg.model!r}: its config has no {', '.join(missing)}; is it a causal LM?"
        )
    return TargetDims(int(c.num_hidden_layers), int(c.hidden_size), int(c.vocab_size))


def kv_cache_gib(text, tokens: int, stored: int = 0) -> int:
    """GiB of a vLLM KV cache on a CPU (``VLLM_CPU_KVCACHE_SPACE``) for ``tokens`` tokens of the target
    ``text`` (its text config) in float32, plus ``stored`` hidden vectors a token (the hidden-state
    extractor's cache-only layer), doubled and at least 1. Set, it also keeps vLLM from reserving its
    default 92% of the host's memory (``gpu_memory_utilization`` on a CPU), which fails on a busy host."""
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * heads * head_dim * 4 + stored * text.hidden_size * 4
    return max(1, -(-2 * tokens * per_token // (1 << 30)))


def extract_footprint(tcfg: TargetConfig, token_budget: int, stored_layers: int, itemsize: int = 2) -> int:
    """About the GPU bytes one extract worker holds (a trainer sharing its GPU leaves them free): the
    target's weights (its text model's parameters, counted on the meta device, ``itemsize`` bytes
    each), the activations of one job's prefill (``token_budget`` tokens: a few hidden-size and two
    MLP-width vectors a token), the stored states and 1 GiB of CUDA context and allocator slack."""
    import torch
    from transformers import AutoModelForCausalLM

    c = target_text_config(tcfg)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(c).parameters())
    H, inter = (
        int(c.hidden_size),
        int(getattr(c, "intermediate_size", 4 * c.hidden_size) or 4 * c.hidden_size),
    )
    act = token_budget * (8 * H + 2 * inter + stored_layers * H) * itemsize
    return params * itemsize + act + (1 << 30)
