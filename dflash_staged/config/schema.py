"""The config's schema: one dataclass per section, each field with its meaning and default, and
the checks of each section's values (``__post_init__``, naming the fix in a :class:`ConfigError`).

Every field has a default, so a file only states what differs. A field whose default is 0 or -1
"meaning derived" keeps that sentinel in the snapshot and is resolved where it is used (a
property below, or the consumer named on the field), so one setting changed later (e.g. by
``--set``) still moves everything derived from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field, fields
from typing import Any

from dflash_staged.config.checks import ConfigError, _check
from dflash_staged.config.train_section import ATTENTION_CHOICES, LOSS_TERMS, TARGET_TERMS, TrainConfig
from dflash_staged.dtypes import STORE_DTYPES

__all__ = ["ATTENTION_CHOICES", "LOSS_TERMS", "TARGET_TERMS", "ConfigError", "TrainConfig"]


def dflash_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash tap rule (what an empty ``target.target_layer_ids`` means):
    round(1 + i*(L-4)/(k-1)) for i in 0..k-1, [L//2] for k == 1."""
    L, k = num_target_layers, num_draft_layers
    if k == 1:
        return [L // 2]
    return [round(1 + i * (L - 4) / (k - 1)) for i in range(k)]


@dataclass
class TargetConfig:
    # "tiny:qwen3", "tiny:qwen3_moe", "tiny:qwen3_5", "tiny:qwen3_next" build a tiny random target in
    # code (see dflash_staged.tiny); anything else is a local directory or hub id.
    model: str = "tiny:qwen3"
    gguf_file: str = ""  # a GGUF file to load the target from (inside `model` when that is a directory)
    tokenizer: str = ""  # where to load the tokenizer from; empty = `model`
    dtype: str = "auto"  # dtype the target runs in; auto = bfloat16 on CUDA, float32 on CPU
    attn_implementation: str = "sdpa"  # the target's attention kernel (transformers' attn_implementation)
    # Tapped layers; empty = the DFlash rule from drafter.num_hidden_layers (dflash_target_layers).
    target_layer_ids: list[int] = field(default_factory=list)
    # Run on the slow PyTorch reference path when the target's fast kernels are missing (else refuse).
    allow_slow_kernels: bool = False
    seed: int = 0  # weights seed of a tiny:* target (ignored for a real model)
    # Also store the target's last decoder layer (its output before the final norm) for every token,
    # beside the taps: the trainer recomputes the target's logits from it (train.loss terms other than
    # ce). Costs one more hidden vector a token on disk (store/shard_store.py).
    store_last_layer: bool = False
    # Also store the target's top-k log-probabilities for every token (ids and values, at
    # topk_temperature): the target's distribution for the train.loss terms at a few hundred bytes a
    # token, without its last layer or head in the trainer (store/shard_store.py). 0 = off.
    store_topk: int = 0
    topk_temperature: float = 1.0  # the temperature the stored top-k log-probabilities are taken at
    # The engine extract runs the target on: "transformers" (in this process, early-stopped forward, --tp
    # groups of this project) or "vllm" (one vLLM engine per extract worker, its hidden-state extractor;
    # --tp N is vLLM's tensor parallel; see dflash_staged/extract/vllm/engine.py).
    engine: str = "transformers"
    vllm_expert_parallel: bool = False  # engine = "vllm": vLLM's expert parallel for an MoE target
    # engine = "vllm": more vllm.LLM arguments (quantization, max_model_len, gpu_memory_utilization, ...)
    vllm_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(
            bool(self.model), "target.model is empty: set it to a model directory, a hub id, or 'tiny:qwen3'"
        )
        _check(self.store_topk >= 0, f"target.store_topk={self.store_topk}: must be >= 0 (0 = off)")
        _check(
            self.topk_temperature > 0,
            f"target.topk_temperature={self.topk_temperature}: must be > 0",
        )
        _check(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"target.dtype={self.dtype!r}: use one of auto, float32, bfloat16, float16",
        )
        _check(
            self.engine in ("transformers", "vllm"),
            f"target.engine={self.engine!r}: use transformers or vllm",
        )
        if self.engine == "vllm":
            from dflash_staged.config.vllm_target import check_vllm_target

            check_vllm_target(self)
        _check(
            all(i >= 0 for i in self.target_layer_ids),
            f"target.target_layer_ids={self.target_layer_ids}: layer ids must be >= 0",
        )
        _check(
            len(set(self.target_layer_ids)) == len(self.target_layer_ids),
            f"target.target_layer_ids={self.target_layer_ids}: remove the duplicate ids",
        )


# apply_chat_template arguments dflash passes itself; data.chat_template_kwargs may not set them.
RENDER_ARGS = {
    "conversation",
    "messages",
    "tokenize",
    "add_generation_prompt",
    "chat_template",
    "continue_final_message",
    "return_dict",
    "return_tensors",
    "return_assistant_tokens_mask",
    "padding",
    "truncation",
    "max_length",
}


@dataclass
class DataConfig:
    max_len: int = 2048  # longest sample, in tokens; longer ones are handled per `overlength`
    overlength: str = "truncate"  # a sample over max_len: "truncate" it to max_len, or "skip" it
    bucket_edges: list[int] = field(default_factory=list)  # length-bucket upper edges; empty = quantiles
    num_buckets: int = 8  # number of length quantile buckets, used when bucket_edges is empty
    token_budget: int = 16384  # padded tokens per planned job (one shard): batch_size x longest <= it
    min_loss_tokens: int = 0  # skip samples with fewer loss tokens; 0 = 2 x drafter.block_size
    # Chat rendering of messages / conversations records (and of `dflash eval` prompts): keyword
    # arguments for the chat template, e.g. { enable_thinking = false } (Qwen3 non-thinking mode);
    # and a Jinja file replacing the tokenizer's template (relative to the working directory, as
    # target.model; its text is recorded in the manifest and counts in the plan's identity).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    chat_template: str = ""

    def __post_init__(self) -> None:
        taken = sorted(set(self.chat_template_kwargs) & RENDER_ARGS)
        _check(
            not taken,
            f"data.chat_template_kwargs.{taken[0] if taken else ''}: dflash sets this argument "
            "of apply_chat_template itself; remove it (use data.chat_template for the "
            "template)",
        )
        _check(self.max_len >= 2, f"data.max_len={self.max_len}: must be >= 2")
        _check(
            self.overlength in ("truncate", "skip"),
            f"data.overlength={self.overlength!r}: use 'truncate' or 'skip'",
        )
        _check(self.num_buckets >= 1, f"data.num_buckets={self.num_buckets}: must be >= 1")
        _check(
            self.bucket_edges == sorted(set(self.bucket_edges)) and all(e > 0 for e in self.bucket_edges),
            f"data.bucket_edges={self.bucket_edges}: use strictly increasing positive lengths",
        )
        _check(
            self.token_budget >= self.max_len,
            f"data.token_budget={self.token_budget} < data.max_len={self.max_len}: raise the budget "
            "so the longest sequence fits a batch",
        )
        _check(self.min_loss_tokens >= 0, "data.min_loss_tokens must be >= 0")


FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)  # drafter layer kinds, spelled as in the reference config.json


def check_layer_types(layer_types: list[str], num_layers: int, sliding_window, where: str) -> str | None:
    """Why ``layer_types`` / ``sliding_window`` are unusable for ``num_layers`` layers (None if fine)."""
    if len(layer_types) != num_layers:
        return (
            f"{where}layer_types has {len(layer_types)} entries for {num_layers} layers; give one per layer"
        )
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad:
        return f"{where}layer_types has {bad}; use {FULL!r} or {SLIDING!r}"
    if SLIDING in layer_types and not (isinstance(sliding_window, int) and sliding_window >= 1):
        return (
            f"{where}sliding_window={sliding_window!r}: {SLIDING} layers need a window of at least 1 "
            "position (it counts the query's own position)"
        )
    return None


@dataclass
class DrafterConfig:
    num_hidden_layers: int = 1  # drafter decoder layers (also how many target layers the DFlash rule taps)
    intermediate_size: int = 0  # MLP width; 0 = 3 x target hidden size (the target's width, see `init`)
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # key/value heads (grouped-query attention); divides num_attention_heads
    head_dim: int = 0  # width of one head; 0 = target hidden / heads
    rms_norm_eps: float = 1e-6  # epsilon of the drafter's RMSNorm layers
    rope_theta: float = 1_000_000.0  # RoPE base frequency
    max_position_embeddings: int = 32768  # the drafter's context length (its config.json, its RoPE tables)
    block_size: int = 16  # tokens per draft block: the anchor plus block_size - 1 predicted tokens
    mask_token_id: int = -1  # token filling a block's unknown positions; -1 = len(tokenizer) when < vocab
    dtype: str = "bfloat16"  # dtype of the saved checkpoint
    # "auto" (target_top where the target's layers fit the drafter, else random, saying why),
    # "target_top" (start from the target's top decoder layers, see model/drafters/init.py; refuses shapes
    # that do not fit), or "random". Except with random, intermediate_size = 0 means the target's
    # MLP width. Measured on the demo: held-out tau 1.24 vs 1.14 (random) at equal budget.
    init: str = "auto"
    # Per layer "full_attention" or "sliding_attention", as in the reference config.json; empty =
    # all full. Sliding layers see a causal window of `sliding_window` positions (their own
    # included): see dflash_staged/model/drafters/attention.py.
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int = 0  # positions a sliding layer sees, its own included (set it with such layers)
    # Whether a layer's queries see later offsets of their own block: "auto" = the serving engines'
    # default (sliding layers causal, full layers bidirectional); true/false = every layer, written
    # to config.json as the top-level is_causal so that serving masks the block as training did.
    is_causal: bool | str = "auto"
    # The drafter family (dflash_staged/model/drafters/registry.py): "dflash" (DFlashDraftModel),
    # "dflash2" (DFlash2DraftModel: in-block convolutions and the candidate selector; the four fields
    # below are its), "dspark" (Qwen3DSparkModel: a Markov head and a confidence head, the anchor row
    # first) or "dspine" (DSpineDraftModel: adjacent causal injection and a refined candidate path).
    architecture: str = "dflash"
    conv_kernel_size: int = 2  # taps of the in-block convolutions (1..block_size)
    conv_group_size: int = 16  # channels sharing one dynamic kernel coefficient (divides the hidden size)
    selector_rank: int = 256  # rank of the selector's predecessor x hidden x successor term
    selector_top_k: int = 16  # candidates per block position the selector chooses among
    # A target's own logit scaling, applied to the drafter's logits wherever they are formed (loss
    # included): u = s * tanh(m * logit / s) with s = final_logit_softcapping > 0, else m * logit.
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    # The block's input embeddings (anchor and mask tokens) times this, in training and serving
    # (the reference's dflash_config.input_embedding_scale).
    input_embedding_scale: float = 1.0
    # The family's own settings ([drafter.options]; each family's folder lists its keys, defaults and
    # rules, e.g. DSpark's markov_rank, DSpine's transfer_rank); unknown keys are refused at train start.
    options: dict[str, Any] = field(default_factory=dict)
    # Rows of the drafter's head: the N most frequent loss-bearing tokens of the planned data (chosen by
    # `dflash plan`, model/drafters/vocab.py); 0 = the target's whole vocabulary. dflash and dspark only.
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        _check(self.draft_vocab_size >= 0, "drafter.draft_vocab_size must be >= 0 (0 = the whole vocabulary)")
        _check(
            self.num_hidden_layers >= 1, f"drafter.num_hidden_layers={self.num_hidden_layers}: must be >= 1"
        )
        _check(self.block_size >= 2, f"drafter.block_size={self.block_size}: must be >= 2")
        _check(
            self.num_attention_heads >= 1 and self.num_key_value_heads >= 1,
            "drafter.num_attention_heads and num_key_value_heads must be >= 1",
        )
        _check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"drafter.num_attention_heads={self.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={self.num_key_value_heads}: pick a divisor",
        )
        _check(
            self.dtype in ("float32", "bfloat16", "float16"),
            f"drafter.dtype={self.dtype!r}: use float32, bfloat16 or float16",
        )
        _check(
            self.init in ("auto", "random", "target_top"),
            f"drafter.init={self.init!r}: use 'auto', 'target_top' or 'random'",
        )
        if self.layer_types:
            why = check_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window, "drafter.")
            _check(why is None, why or "")
        _check(
            isinstance(self.is_causal, bool) or self.is_causal == "auto",  # (0.0 == False: not a bool)
            f'drafter.is_causal={self.is_causal!r}: expected true, false or "auto"',
        )
        _check(
            self.architecture != "dflash2" or 1 <= self.conv_kernel_size <= self.block_size,
            f"drafter.conv_kernel_size={self.conv_kernel_size}: use 1..block_size ({self.block_size})",
        )
        _check(
            self.conv_group_size >= 1 and self.selector_rank >= 1 and self.selector_top_k >= 1,
            "drafter.conv_group_size, selector_rank and selector_top_k must be >= 1",
        )
        _check(
            self.output_multiplier > 0 and self.final_logit_softcapping >= 0,
            "drafter.output_multiplier must be > 0 and final_logit_softcapping >= 0 (0 = none)",
        )
        _check(self.input_embedding_scale > 0, "drafter.input_embedding_scale must be > 0")


@dataclass
class ExtractConfig:
    window: int = 64  # shards claimed, written or consumed but not released
    window_bytes: int = 0  # the same window in bytes; 0 = no byte limit
    lease_s: float = 300.0  # a claim's lease: a claimed job not renewed for this long is reclaimed
    # A tensor-parallel group's collective timeout: a rank waiting longer in one gives up (extract/group.py);
    # 0 = lease_s, so no rank waits longer than a claim lives.
    collective_timeout_s: float = 0.0
    # How long a registered process (extractor, trainer) counts as alive, seen from another host, after
    # its last heartbeat (it beats every 1/4 of it; PostgreSQL manifests, manifest/postgres/procs.py);
    # 0 = lease_s.
    registration_liveness_s: float = 0.0
    max_attempts: int = 3  # a job whose extraction failed this many times is marked failed, not retried
    compression: str = "none"  # compression of the shards' tensors: none | zstd
    # The hidden states' precision in the shards: "target" (the target's dtype) or "float8_e4m3fn" (one
    # byte a value and a float32 scale per token and layer: about half the bytes; store/fp8.py).
    store_dtype: str = "target"

    def __post_init__(self) -> None:
        _check(self.window >= 1, f"extract.window={self.window}: must be >= 1")
        _check(
            self.store_dtype in STORE_DTYPES,
            f"extract.store_dtype={self.store_dtype!r}: use one of {', '.join(map(repr, STORE_DTYPES))}",
        )
        _check(self.window_bytes >= 0, "extract.window_bytes must be >= 0 (0 = unlimited)")
        _check(self.lease_s > 0, "extract.lease_s must be > 0")
        for key in ("collective_timeout_s", "registration_liveness_s"):
            _check(
                getattr(self, key) >= 0,
                f"extract.{key}={getattr(self, key)}: must be > 0, or 0 (the default) to use extract.lease_s",
            )
        _check(self.max_attempts >= 1, "extract.max_attempts must be >= 1")
        _check(
            self.compression in ("none", "zstd"),
            f"extract.compression={self.compression!r}: use 'none' or 'zstd'",
        )

    @property
    def collective_timeout(self) -> float:
        """Seconds: ``collective_timeout_s``, or ``lease_s`` where that is 0."""
        return self.collective_timeout_s or self.lease_s

    @property
    def registration_liveness(self) -> float:
        """Seconds: ``registration_liveness_s``, or ``lease_s`` where that is 0 (as in a plan made before
        the setting existed, whose snapshot lacks it)."""
        return self.registration_liveness_s or self.lease_s


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def plan_hash(self) -> str:
        """Hash of the settings that shape the plan and the shards (not runtime knobs)."""
        d = self.to_dict()
        target = dict(d["target"])
        if not target.get("store_last_layer"):  # a plan made before the setting existed keeps its hash
            target.pop("store_last_layer", None)
        if not target.get("store_topk"):  # likewise
            target.pop("store_topk", None)
            target.pop("topk_temperature", None)
        fp8 = d["extract"]["store_dtype"] != "target"  # a plan at the default keeps its hash
        keep = {
            **({"store_dtype": d["extract"]["store_dtype"]} if fp8 else {}),
            "target": target,
            "data": d["data"],
            "drafter": {
                "block_size": d["drafter"]["block_size"],
                "num_hidden_layers": d["drafter"]["num_hidden_layers"],
            },
        }
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def min_loss_tokens(self) -> int:
        return self.data.min_loss_tokens or 2 * self.drafter.block_size


SECTIONS = {f.name: f.type for f in fields(Config)}
_SECTION_CLASSES = {
    "target": TargetConfig,
    "data": DataConfig,
    "drafter": DrafterConfig,
    "train": TrainConfig,
    "extract": ExtractConfig,
}
