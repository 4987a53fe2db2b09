"""What the engine replays share: a parameter table, the load report, and the Qwen3 block backbone that
vLLM's ``DFlashQwen3Model`` and SGLang's ``DFlashDraftModel`` both build (tensor parallel size 1).

Both engines merge ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` (shards ``q``, ``k``, ``v``) and
``gate_proj``/``up_proj`` into ``gate_up_proj`` (shards 0, 1); their weight loaders assert that a tensor
(or a shard) has the parameter's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class Refused(Exception):
    """The engine would stop here: it raises while reading the config or loading the weights."""


@dataclass
class Param:
    shape: tuple[int, ...]
    shards: dict | None = None  # a stacked parameter: shard id -> the shape one checkpoint tensor fills


@dataclass
class Load:
    """The outcome of a replayed load: the engine's parameters, where each checkpoint tensor went, and the
    numbers the engine's forward uses (``view``)."""

    engine: str
    model: str  # the engine's model class
    params: dict[str, Param]
    view: dict
    routes: dict[str, tuple[str, object]] = field(default_factory=dict)  # key -> (param, shard)
    ignored: dict[str, str] = field(default_factory=dict)  # key -> why the engine's loader dropped it
    shared: set[str] = field(default_factory=set)  # taken from the target after loading
    unused: set[str] = field(default_factory=set)  # placeholders no forward reads for this checkpoint

    def route(self, key: str, shape: tuple[int, ...], name: str, shard=None) -> None:
        """Load checkpoint tensor ``key`` into ``name`` (a shard of it): the weight loaders' shape check."""
        p = self.params[name]
        want = p.shape if shard is None else p.shards[shard]
        if tuple(shape) != tuple(want):
            raise Refused(f"{self.engine}: attempted to load weight {key} {tuple(shape)} into {name} {want}")
        self.routes[key] = (name, shard)

    def unloaded(self) -> set[str]:
        """Parameters (not shared, not unused, not empty) that no checkpoint tensor filled completely."""
        done: dict[str, set] = {}
        for name, shard in self.routes.values():
            done.setdefault(name, set()).add(shard)
        out = set()
        for name, p in self.params.items():
            if name in self.shared | self.unused or 0 in p.shape:
                continue
            need = set(p.shards) if p.shards else {None}
            if not need <= done.get(name, set()):
                out.add(name)
        return out


STACKED = {  # checkpoint name -> (engine name, shard id), as both engines merge them
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def dims(c: dict) -> tuple[int, int, int, int, int, int, int]:
    """(H, I, layers, heads, kv heads, head_dim, vocab) as both engines read them from config.json."""
    H, nh = int(c["hidden_size"]), int(c["num_attention_heads"])
    return (
        H,
        int(c["intermediate_size"]),
        int(c["num_hidden_layers"]),
        nh,
        int(c.get("num_key_value_heads", nh)),
        int(c.get("head_dim") or H // nh),
        int(c["vocab_size"]),
    )


def backbone(c: dict, fc_in: int, prefix: str = "") -> dict[str, Param]:
    """The block backbone's parameters: merged attention and MLP projections, q/k norms, the layer norms,
    ``norm``, ``fc`` (``fc_in -> H``) and ``hidden_norm``; no biases (``attention_bias`` false)."""
    H, inter, L, nh, nkv, hd, _ = dims(c)
    out = {f"{prefix}fc.weight": Param((H, fc_in)), f"{prefix}hidden_norm.weight": Param((H,))}
    out[f"{prefix}norm.weight"] = Param((H,))
    for i in range(L):
        p = f"{prefix}layers.{i}."
        q, kv = (nh * hd, H), (nkv * hd, H)
        out[p + "self_attn.qkv_proj.weight"] = Param(((nh + 2 * nkv) * hd, H), {"q": q, "k": kv, "v": kv})
        out[p + "self_attn.o_proj.weight"] = Param((H, nh * hd))
        out[p + "self_attn.q_norm.weight"] = Param((hd,))
        out[p + "self_attn.k_norm.weight"] = Param((hd,))
        out[p + "mlp.gate_up_proj.weight"] = Param((2 * inter, H), {0: (inter, H), 1: (inter, H)})
        out[p + "mlp.down_proj.weight"] = Param((H, inter))
        out[p + "input_layernorm.weight"] = Param((H,))
        out[p + "post_attention_layernorm.weight"] = Param((H,))
    return out


def conv_params(c: dict, prefix: str, taps: int, group: int) -> dict[str, Param]:
    """DFlash2's two in-block convolutions a layer (``base_kernel [2, taps, H]``, ``kernel_projection``
    ``H -> 2 * taps * H / group``), as both engines build them."""
    H, L = int(c["hidden_size"]), int(c["num_hidden_layers"])
    out = {}
    for i in range(L):
        for side in ("attention_conv", "mlp_conv"):
            p = f"{prefix}layers.{i}.{side}."
            out[p + "base_kernel"] = Param((2, taps, H))
            out[p + "kernel_projection.weight"] = Param((2 * taps * (H // group), H))
    return out


def selector_params(c: dict, prefix: str, rank: int) -> dict[str, Param]:
    """DFlash2's candidate selector: two ``[V, rank]`` codebooks and ``hidden_projection`` ``H -> rank``."""
    H, V = int(c["hidden_size"]), int(c["vocab_size"])
    p = f"{prefix}candidate_selector."
    return {
        p + "predecessor_codebook": Param((V, rank)),
        p + "successor_codebook": Param((V, rank)),
        p + "hidden_projection.weight": Param((rank, H)),
    }


def attention_layers(c: dict, window_of) -> list[tuple[int, bool]]:
    """Per layer (sliding window or 0, causal within the block): a top-level ``is_causal`` wins, else a
    sliding layer is causal and a full one bidirectional (both engines' rule); ``window_of()`` gives the
    window an engine reads (or raises ``Refused``)."""
    types = c.get("layer_types") or ["full_attention"] * int(c["num_hidden_layers"])
    out = []
    for t in types:
        sliding = t == "sliding_attention"
        causal = c.get("is_causal")
        out.append((window_of() if sliding else 0, bool(sliding if causal is None else causal)))
    return out


def transform(x: torch.Tensor, multiplier: float, softcap: float | None, order: str) -> torch.Tensor:
    """A logit transform in an engine's order: ``"scale_first"`` (``s * tanh(m x / s)``) or ``"cap_first"``
    (``m * s * tanh(x / s)``)."""
    if order == "cap_first":
        x = softcap * torch.tanh(x / softcap) if softcap else x
        return x * multiplier
    x = x * multiplier
    return softcap * torch.tanh(x / softcap) if softcap else x
