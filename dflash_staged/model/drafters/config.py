"""The reference DFlash drafter ``config.json`` (z-lab ``DFlashDraftModel``) as a dataclass.

:meth:`DraftModelConfig.to_dict` writes what the reference ``dflash`` package,
SGLang, vLLM and the MLX port read: the Qwen3 fields (``model_type: qwen3``),
``architectures: ["DFlashDraftModel"]``, ``block_size`` and ``num_target_layers`` at
top level, ``dflash_config: {block_size, mask_token_id, target_layer_ids}``,
``layer_types`` (one of ``full_attention`` / ``sliding_attention`` per layer) with
``sliding_window`` and ``use_sliding_window`` (true when a layer slides; transformers
drops ``sliding_window`` otherwise), ``dtype`` (the dtype of the stored weights), and
RoPE in both spellings (``rope_theta``/``rope_scaling`` for transformers 4.x and MLX,
``rope_parameters`` for transformers 5 and vLLM). What a sliding layer attends to is
written in :mod:`dflash_staged.model.drafters.attention`; a top-level ``is_causal`` is written
whenever it is set (the reference and SGLang then apply it to every layer).

Another family (``architecture``, :mod:`dflash_staged.model.drafters.registry`) names its own
``architectures`` and adds its fields (:meth:`~dflash_staged.model.drafters.family.Family.write_config`;
DFlash2: ``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and ``selector_top_k`` in
``dflash_config``, z-lab's released ``Qwen3.8-27B-DFlash2`` layout); ``options`` holds the settings of a
family beyond DFlash2 (``[drafter.options]``), checked by the family. ``output_multiplier``,
``final_logit_softcapping`` and ``input_embedding_scale`` (the block's input embeddings are multiplied
by it) go there too, for either architecture, when they are set; a DFlash or DFlash2
``output_multiplier`` also as a top-level ``logit_scale``, where vLLM reads it (not DSpark's:
:mod:`dflash_staged.model.drafters.engines`). :meth:`DraftModelConfig.from_dict` reads ours and the
released drafters' files, and these fields as the reference does: from ``dflash_config``, else from the
top level; a negative softcap is refused. ``draft_vocab_size`` (top level, only when the head covers fewer
rows than ``vocab_size``; :mod:`dflash_staged.model.drafters.vocab`) is refused for a family that cannot
take one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dflash_staged.config import FULL, SLIDING, check_layer_types
from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.registry import FAMILIES, family, family_of

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURES = {name: f.architecture for name, f in FAMILIES.items()}


@dataclass
class DraftModelConfig:
    """The fields of the reference DFlash ``config.json`` this package reads and writes."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    dtype: str = "bfloat16"
    layer_types: list[str] = field(default_factory=list)  # empty = every layer full_attention
    sliding_window: int | None = None  # positions a sliding_attention layer sees, its own included
    is_causal: bool | None = None  # None = sliding layers causal, full layers bidirectional
    architecture: str = "dflash"  # a family of dflash_staged.model.drafters.registry
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None or 0 = no softcapping
    input_embedding_scale: float = 1.0  # the block's input embeddings are multiplied by it
    options: dict[str, Any] = field(default_factory=dict)  # the family's own settings (its defaults filled)
    draft_vocab_size: int | None = None  # rows of the drafter's head (None: the target's whole vocabulary)
    extra: dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, kept on round trip

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise DflashError(f"drafter config: {msg}")

        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "num_target_layers",
        ):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        need(self.block_size >= 2, f"block_size={self.block_size} must be >= 2")
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads={self.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={self.num_key_value_heads}",
        )
        need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even (RoPE)")
        need(len(self.target_layer_ids) >= 1, "target_layer_ids is empty")
        need(
            all(0 <= i < self.num_target_layers for i in self.target_layer_ids),
            f"target_layer_ids={self.target_layer_ids} must lie in 0..{self.num_target_layers - 1}",
        )
        need(
            0 <= self.mask_token_id < self.vocab_size,
            f"mask_token_id={self.mask_token_id} must lie in 0..{self.vocab_size - 1}",
        )
        need(self.hidden_act == "silu", f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        need(
            self.dtype in ("float32", "bfloat16", "float16"),
            f"dtype={self.dtype!r}: use float32, bfloat16 or float16",
        )
        fam = self.family
        if fam.forced_causal is not None:
            need(
                self.is_causal in (None, fam.forced_causal),
                f"is_causal={self.is_causal}: a {fam.name} drafter has is_causal={fam.forced_causal}",
            )
            self.is_causal = fam.forced_causal
        need(self.output_multiplier > 0, f"output_multiplier={self.output_multiplier} must be > 0")
        need(
            self.final_logit_softcapping is None or float(self.final_logit_softcapping) >= 0,
            f"final_logit_softcapping={self.final_logit_softcapping} must be > 0 (or absent, or 0: none)",
        )
        need(
            self.input_embedding_scale > 0,
            f"input_embedding_scale={self.input_embedding_scale} must be > 0",
        )
        self.final_logit_softcapping = float(self.final_logit_softcapping or 0) or None
        self.layer_types = list(self.layer_types) or [FULL] * self.num_hidden_layers
        why = check_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window, "")
        need(why is None, why or "")
        if SLIDING not in self.layer_types:
            self.sliding_window = None
        self.options = fam.options(self.options, self)
        n = self.draft_vocab_size
        if n is not None and int(n) >= self.vocab_size:
            self.draft_vocab_size = n = None  # the whole vocabulary: no table
        if n is not None:
            need(1 <= int(n), f"draft_vocab_size={n} must be >= 1 (or absent: the whole vocabulary)")
            why = fam.draft_vocab_refused
            need(
                why is None,
                f"draft_vocab_size={n}: a {fam.name} drafter cannot take a draft vocabulary "
                f"({why}); set drafter.draft_vocab_size = 0 or use architecture dflash or dspark",
            )
            self.draft_vocab_size = int(n)

    @property
    def family(self):
        """The drafter family (:mod:`dflash_staged.model.drafters.registry`)."""
        return family(self.architecture)

    @property
    def use_sliding_window(self) -> bool:
        return SLIDING in self.layer_types

    def layer_causal(self, layer: int) -> bool:
        """Whether layer ``layer``'s queries see only earlier offsets of their block (the reference rule)."""
        return self.layer_types[layer] == SLIDING if self.is_causal is None else bool(self.is_causal)

    @classmethod
    def from_config(
        cls,
        cfg,
        target_hidden: int,
        target_vocab: int,
        num_target_layers: int,
        layer_ids: list[int],
        mask_token_id: int,
    ) -> DraftModelConfig:
        """Build from the project :class:`~dflash_staged.config.Config` plus facts about the target."""
        d = cfg.drafter
        heads = d.num_attention_heads
        if not d.head_dim and target_hidden % heads:
            raise DflashError(
                f"drafter.head_dim=0 needs target hidden size {target_hidden} divisible by "
                f"drafter.num_attention_heads={heads}; set drafter.head_dim"
            )
        return cls(
            hidden_size=target_hidden,
            intermediate_size=d.intermediate_size or 3 * target_hidden,
            num_hidden_layers=d.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=d.num_key_value_heads,
            head_dim=d.head_dim or target_hidden // heads,
            vocab_size=target_vocab,
            block_size=d.block_size,
            num_target_layers=num_target_layers,
            target_layer_ids=list(layer_ids),
            mask_token_id=mask_token_id,
            rms_norm_eps=d.rms_norm_eps,
            rope_theta=d.rope_theta,
            max_position_embeddings=d.max_position_embeddings,
            dtype=d.dtype,
            layer_types=list(d.layer_types),
            sliding_window=d.sliding_window or None,
            is_causal=None if d.is_causal == "auto" else bool(d.is_causal),
            architecture=d.architecture,
            conv_kernel_size=d.conv_kernel_size,
            conv_group_size=d.conv_group_size,
            selector_rank=d.selector_rank,
            selector_top_k=d.selector_top_k,
            output_multiplier=d.output_multiplier,
            final_logit_softcapping=d.final_logit_softcapping or None,
            input_embedding_scale=d.input_embedding_scale,
            options=dict(d.options),
            draft_vocab_size=d.draft_vocab_size or None,
        )

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """transformers-5 style RoPE parameters (``rope_type`` + ``rope_theta`` + scaling fields)."""
        p = dict(self.rope_scaling or {})
        p["rope_type"] = p.pop("type", None) or p.get("rope_type") or "default"
        p["rope_theta"] = float(self.rope_theta)
        return p

    def to_dict(self) -> dict[str, Any]:
        """The reference ``config.json`` content (Qwen3 fields + DFlash fields).

        Both RoPE spellings are written: ``rope_theta``/``rope_scaling`` (transformers 4.x,
        the reference package, MLX) and ``rope_parameters`` (transformers 5, vLLM).
        ``block_size`` sits at top level (reference) and in ``dflash_config`` (SGLang).
        """
        d: dict[str, Any] = dict(self.extra)
        dflash = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        fam = self.family
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        if self.output_multiplier != 1.0 and fam.name in ("dflash", "dflash2"):
            d["logit_scale"] = self.output_multiplier  # what vLLM's DFlash multiplies its logits by
        d.update(
            {
                "architectures": [fam.architecture],
                "model_type": "qwen3",
                "attention_bias": False,
                "attention_dropout": 0.0,
                "block_size": self.block_size,
                "dflash_config": dflash,
                "dtype": self.dtype,
                "head_dim": self.head_dim,
                "hidden_act": self.hidden_act,
                "hidden_size": self.hidden_size,
                "initializer_range": 0.02,
                "intermediate_size": self.intermediate_size,
                "layer_types": list(self.layer_types),
                "max_position_embeddings": self.max_position_embeddings,
                "max_window_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_hidden_layers": self.num_hidden_layers,
                "num_key_value_heads": self.num_key_value_heads,
                "num_target_layers": self.num_target_layers,
                "rms_norm_eps": self.rms_norm_eps,
                "rope_parameters": self.rope_parameters,
                "rope_scaling": self.rope_scaling,
                "rope_theta": self.rope_theta,
                "sliding_window": self.sliding_window,
                "tie_word_embeddings": False,
                "use_cache": True,
                "use_sliding_window": self.use_sliding_window,
                "vocab_size": self.vocab_size,
            }
        )
        if self.draft_vocab_size:  # where vLLM's DFlash and DSpark models and llama.cpp's converter read it
            d["draft_vocab_size"] = self.draft_vocab_size
        fam.write_config(self, d, dflash)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> DraftModelConfig:
        """Parse a reference ``config.json`` (ours or a released z-lab drafter)."""
        fam = family_of(d.get("architectures"), source)
        d = dict(d)  # the family may fill dflash_config from its own fields
        own = fam.read_config(d, source)
        dfl = d.get("dflash_config") or {}
        causal = d.get("is_causal")
        types = list(d.get("layer_types") or [])
        window = d.get("sliding_window")
        if SLIDING in types and not d.get("use_sliding_window"):
            raise DflashError(
                f"{source}: layer_types has {SLIDING} layers but use_sliding_window is not true, so "
                "transformers would drop sliding_window; set use_sliding_window: true and sliding_window"
            )
        if types and (
            why := check_layer_types(
                types, int(d.get("num_hidden_layers", len(types))), window, f"{source}: "
            )
        ):
            raise DflashError(why)
        if d.get("attention_bias"):
            raise DflashError(f"{source}: attention_bias=true is not supported")
        rope_theta = d.get("rope_theta")
        scaling = d.get("rope_scaling")
        params = d.get("rope_parameters")
        if params:  # transformers 5 spelling wins, as in transformers
            params = dict(params)
            rope_theta = params.pop("rope_theta", rope_theta)
            scaling = params if params.get("rope_type", "default") != "default" else None
        try:
            heads = int(d["num_attention_heads"])
            block = d.get("block_size", dfl.get("block_size"))
            if block is None:
                raise KeyError("block_size")
            out = cls(
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
                vocab_size=int(d["vocab_size"]),
                block_size=int(block),
                num_target_layers=int(d["num_target_layers"]),
                target_layer_ids=[int(i) for i in dfl["target_layer_ids"]],
                mask_token_id=int(dfl["mask_token_id"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                hidden_act=d.get("hidden_act", "silu"),
                dtype=str(d.get("dtype") or d.get("torch_dtype") or "bfloat16"),
                layer_types=types,
                sliding_window=int(window) if SLIDING in types else None,
                is_causal=None if causal is None else bool(causal),
                architecture=fam.name,
                **own,
                output_multiplier=float(_draft_value(d, "output_multiplier", 1.0)),
                final_logit_softcapping=_draft_value(d, "final_logit_softcapping"),
                input_embedding_scale=float(_draft_value(d, "input_embedding_scale", 1.0)),
                draft_vocab_size=int(d["draft_vocab_size"]) if d.get("draft_vocab_size") else None,
            )
        except KeyError as e:
            raise DflashError(
                f"{source}: missing field {e.args[0]!r}; this is not a complete DFlash drafter config"
            ) from None
        known = set(cls.__dataclass_fields__) | set(out.to_dict()) | {"is_causal", "torch_dtype"}
        out.extra = {k: v for k, v in d.items() if k not in known}
        return out

    @classmethod
    def from_json(cls, text: str, source: str = "config.json") -> DraftModelConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise DflashError(f"{source}: invalid JSON ({e}); the checkpoint is damaged") from None
        return cls.from_dict(d, source)

    def hf_config(self):
        """A transformers ``Qwen3Config`` with these fields (used for the RoPE tables).

        transformers 5 reads RoPE from ``rope_parameters``; 4.x (4.57, the floor) from
        ``rope_theta`` and ``rope_scaling`` with a ``rope_type`` key. Both are handled."""
        from transformers import Qwen3Config

        fields = dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
        )
        if hasattr(Qwen3Config(), "rope_parameters"):  # transformers >= 5
            return Qwen3Config(**fields, rope_parameters=self.rope_parameters)
        scaling = {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
        return Qwen3Config(
            **fields,
            rope_theta=float(self.rope_theta),
            rope_scaling=None if scaling["rope_type"] == "default" else scaling,
        )


def _draft_value(d: dict[str, Any], name: str, default=None):
    """A DFlash field as the reference reads it: from ``dflash_config``, else from the top level."""
    dfl = d.get("dflash_config") or {}
    if dfl.get(name) is not None:
        return dfl[name]
    return d.get(name, default) if d.get(name) is not None else default


_TEMPLATE = dict(
    hidden_size=8,
    intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=8,
    vocab_size=8,
    block_size=2,
    num_target_layers=1,
    target_layer_ids=[0],
    mask_token_id=0,
)
