"""What ``[target] engine = "vllm"`` can serve, refused up front with one line each (plan and every command
that loads the config): vLLM's hidden-state extractor runs a model directory or hub id through
``vllm.LLM``, with settings this project owns (the extractor's speculative and connector configs, prefix
caching and chunked prefill off, tensor parallel from ``--tp``), and cannot run pipeline parallel (vLLM
#53015) or an MLA target (the extractor's cache group; vLLM's example connector refuses them too).
"""

from __future__ import annotations

from dflash_staged.config.checks import ConfigError

# vllm.LLM arguments the extract engine sets itself (dflash_staged/extract/vllm/engine.py), and why.
OWNED = {
    "model": "target.model",
    "tokenizer": "the engine takes token ids (no tokenizer)",
    "skip_tokenizer_init": "the engine takes token ids (no tokenizer)",
    "dtype": "target.dtype",
    "speculative_config": "the hidden-state extractor's settings (the tapped layers)",
    "kv_transfer_config": "this project's connector",
    "enable_prefix_caching": "off: cache hits shorten what the extractor saves",
    "enable_chunked_prefill": "off: the extractor needs a prompt in one step",
    "tensor_parallel_size": "extract --tp N",
    "enable_expert_parallel": "target.vllm_expert_parallel",
    "data_parallel_size": "data parallel is one extract worker per replica: --devices cuda:0,cuda:1,...",
    "pipeline_parallel_size": "vLLM's hidden-state extractor cannot run pipeline parallel (vLLM #53015)",
    "seed": "target.seed",
}
# model types whose attention is MLA (a latent KV cache): the extractor cannot serve them
MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_linear"}


def check_vllm_target(cfg) -> None:
    """``cfg`` (a :class:`~dflash_staged.config.TargetConfig` with ``engine = "vllm"``) asks nothing vLLM's
    extractor cannot do; else :class:`ConfigError` naming the field and the fix."""
    if cfg.model.startswith("tiny:"):
        raise ConfigError(
            f"target.model={cfg.model!r} with target.engine='vllm': vLLM loads a model directory or hub id; "
            "save the tiny target (save_pretrained) and name that directory, or use engine = 'transformers'"
        )
    if cfg.gguf_file:
        raise ConfigError(
            f"target.gguf_file={cfg.gguf_file!r} with target.engine='vllm': extract through vLLM from the "
            "model's safetensors directory, or use engine = 'transformers'"
        )
    for key in sorted(set(cfg.vllm_args) & set(OWNED)):
        if key == "pipeline_parallel_size" and int(cfg.vllm_args[key] or 1) == 1:
            continue
        raise ConfigError(f"target.vllm_args.{key}: not settable here ({OWNED[key]})")


def check_vllm_model(model_type: str, text_config: dict, where: str) -> None:
    """Refuse a target vLLM's extractor cannot serve (MLA), from its ``config.json`` at ``where``."""
    if model_type in MLA_MODEL_TYPES or text_config.get("kv_lora_rank"):
        raise ConfigError(
            f"{where}: {model_type} uses MLA attention, which vLLM's hidden-state extractor cannot serve; "
            "use target.engine = 'transformers' for it"
        )
