"""Tiny random targets and an offline tokenizer, built from configs in code.

Used by ``configs/tiny.toml`` (``target.model = "tiny:qwen3"``), by the tests and
by the CPU benchmarks. Nothing is downloaded. Every tiny model is built with a
fixed seed, so two processes building ``tiny:qwen3`` get identical weights.

Vocabulary: 2048 ids; ids 0..3 are the special tokens pad, bos, eos, mask; the
data may use any id from 4 to 2047. The tokenizer adds the ChatML markers
``<|im_start|>`` (4) and ``<|im_end|>`` (5) and a byte-level BPE above them.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

VOCAB = 2048
PAD, BOS, EOS, MASK = 0, 1, 2, 3
FIRST_DATA_ID = 4
KINDS = ("qwen3", "qwen3_5", "qwen3_next", "qwen3_moe")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_HYBRID_LAYERS = ["linear_attention"] * 3 + ["full_attention"]


def tiny_config(kind: str = "qwen3"):
    """A transformers config for a tiny target of `kind` (qwen3, qwen3_moe, qwen3_5, qwen3_next)."""
    common = dict(
        vocab_size=VOCAB,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if kind == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            **common,
        )
    if kind == "qwen3_moe":  # Qwen3-MoE: every layer's MLP is 4 routed experts, top-2
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            decoder_sparse_step=1,
            **common,
        )
    hybrid = dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=_HYBRID_LAYERS * 2,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        **common,
    )
    if kind == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**hybrid)
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            decoder_sparse_step=1,
            **hybrid,
        )
    raise ValueError(f"unknown tiny target kind {kind!r}; use one of {', '.join(KINDS)}")


def build_tiny_model(kind: str = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32):
    """Build the tiny causal LM of `kind` with deterministic random weights."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(kind)
    cfg._attn_implementation = "sdpa"
    devnull_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    finally:
        torch.random.set_rng_state(devnull_state)
    return model.eval()


def save_tiny_model(dir: str | Path, kind: str = "qwen3", seed: int = 0) -> Path:
    """Write the tiny model and tokenizer as an ordinary HF directory (safetensors)."""
    dir = Path(dir)
    build_tiny_model(kind, seed).save_pretrained(dir)
    build_tiny_tokenizer().save_pretrained(dir)
    return dir


def _corpus() -> list[str]:
    words = (
        "the of and to in is was for on with as by at from that this it be are an or which "
        "model token layer draft target block speculative decoding training data hidden state "
        "shard store manifest epoch bucket length batch worker window checkpoint resume replay "
        "what is capital france paris answer question explain why how when where who write code "
        "python function return value list number one two three four five six seven eight nine ten "
        "hello world please thank you sure here great good small large fast slow red blue green"
    ).split()
    lines = []
    for i in range(4000):
        n = 5 + (i * 7) % 13
        lines.append(
            " ".join(words[(i * 31 + j * 17 + (i // 7) * j) % len(words)] for j in range(n)) + f" {i % 1000}."
        )
    return lines


@functools.lru_cache(maxsize=1)
def _tokenizer_dir() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<bos>", "<eos>", "<mask>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<|im_end|>",
        mask_token="<mask>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<eos>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(tempfile.mkdtemp(prefix="dflash-tiny-tok-"))
    fast.save_pretrained(out)
    return str(out)


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer (vocab <= 2048) with a ChatML chat template, built offline."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tokenizer_dir())
    assert tok.convert_tokens_to_ids("<mask>") == MASK and tok.pad_token_id == PAD
    assert len(tok) <= VOCAB
    return tok
