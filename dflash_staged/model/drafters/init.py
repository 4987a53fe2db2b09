"""Initialising a drafter from the target (``[drafter] init = "target_top"``).

The drafter has the target's hidden size, so its decoder layers can start as copies of the
target's top decoder layers instead of random weights. Rules:

* drafter layer ``i`` of ``n`` starts from the ``i``-th of the target's last ``n`` attention layers
  (in a hybrid target, its full-attention layers; linear-attention layers have no q/k/v);
* copied per layer: ``self_attn.{q,k,v,o}_proj`` (of a gated attention, as in Qwen3.5's and
  Qwen3-Next's full-attention layers, the query half of ``q_proj``: the output gate is dropped),
  ``self_attn.{q,k}_norm`` (left at ones where the target has none, e.g. Llama),
  ``mlp.{gate,up,down}_proj`` (a mixture of experts gives its shared expert's, else the MLP stays
  random), ``input_layernorm`` and ``post_attention_layernorm``;
* norms are the drafter's RMSNorm (``weight * x``); a target whose RMSNorm is zero-centred
  (``(1 + weight) * x``: Qwen3.5, Qwen3-Next, Gemma) gets ``1 + weight`` copied;
* the drafter's final ``norm`` starts as the target's final norm, ``hidden_norm`` at ones, and
  ``fc`` as the identity on the deepest tapped layer (zero on the others), so the fused context
  starts as that layer's hidden state;
* GQA: with the same query heads and head size, a drafter with ``m`` times the target's KV heads
  gets each target KV head repeated ``m`` times (exactly the same attention); one with fewer KV
  heads gets the mean of each group of target KV heads (GQA uptraining). Anything else (other
  query heads, head size or MLP width) is refused, naming the setting to change.
"""

from __future__ import annotations

import re

import torch

from dflash_staged.errors import DflashError
from dflash_staged.model.target.weights import ZERO_CENTRED_NORMS, open_target_tensors

_LAYER = re.compile(r"^(.*?)layers\.(\d+)\.self_attn\.q_proj\.weight$")


def _kv(w: torch.Tensor, src_heads: int, dst_heads: int, head_dim: int) -> torch.Tensor:
    """k/v projection ``[src_heads * hd, H]`` -> ``[dst_heads * hd, H]`` (repeat or group-mean)."""
    if src_heads == dst_heads:
        return w
    heads = w.unflatten(0, (src_heads, head_dim))
    if dst_heads % src_heads == 0:
        return heads.repeat_interleave(dst_heads // src_heads, 0).flatten(0, 1)
    return (
        heads.unflatten(
            0,
            (
                dst_heads,
                src_heads // dst_heads,
            ),
        )
        .mean(1)
        .flatten(0, 1)
    )


def target_top_layout(c, target_cfg):
    """Whether the target's top layers fit a drafter of config ``c`` (refused in one line otherwise; read
    from the weights' headers and config, no tensor loaded): ``(tensors, [(prefix, layer)], text config,
    heads, kv heads, head_dim)``. ``dflash plan`` calls it for ``drafter.init = 'target_top'``."""
    src = open_target_tensors(target_cfg)
    found = sorted(
        {(m.group(1), int(m.group(2))) for n in src.names if (m := _LAYER.match(n))}, key=lambda x: x[1]
    )
    n = c.num_hidden_layers
    if len(found) < n:
        raise DflashError(
            f"drafter.init = 'target_top': the target has {len(found)} attention layers with q/k/v "
            f"projections, the drafter {n}; use fewer drafter.num_hidden_layers or init = 'random'"
        )
    tcfg = src.config.get("text_config") or src.config
    t_heads = int(tcfg.get("num_attention_heads", c.num_attention_heads))
    t_kv = int(tcfg.get("num_key_value_heads") or t_heads)
    t_hd = int(tcfg.get("head_dim") or c.hidden_size // t_heads)
    if (t_heads, t_hd) != (c.num_attention_heads, c.head_dim):
        raise DflashError(
            f"drafter.init = 'target_top': the target's attention has {t_heads} heads of size {t_hd}, "
            f"the drafter {c.num_attention_heads} of size {c.head_dim}; set drafter.num_attention_heads "
            f"= {t_heads} and drafter.head_dim = {t_hd}, or init = 'random'"
        )
    if t_kv % c.num_key_value_heads and c.num_key_value_heads % t_kv:
        raise DflashError(
            f"drafter.init = 'target_top': {c.num_key_value_heads} drafter KV heads cannot be made from "
            f"the target's {t_kv}; use a multiple or a divisor of {t_kv}"
        )
    return src, found, tcfg, t_heads, t_kv, t_hd


def init_from_target(drafter, target_cfg) -> list[str]:
    """Copy the target's top layers into ``drafter`` (in place); returns what was copied, one line each."""
    c = drafter.dcfg
    n = c.num_hidden_layers
    src, found, tcfg, t_heads, t_kv, t_hd = target_top_layout(c, target_cfg)
    prefix = found[0][0]
    params = dict(drafter.named_parameters())
    copied: list[str] = []

    def put(dst: str, name: str, fn=lambda w: w) -> bool:
        if name not in src.names:
            return False
        w = fn(src.get(name).float())
        if tuple(w.shape) != tuple(params[dst].shape):
            fix = (
                "set drafter.intermediate_size to the target's (0 does that with target_top)"
                if ".mlp." in dst
                else "this target's layers do not fit the drafter's"
            )
            raise DflashError(
                f"drafter.init = 'target_top': {name} has shape {tuple(w.shape)}, the drafter's "
                f"{dst} {tuple(params[dst].shape)}: {fix}; or use init = 'random'"
            )
        with torch.no_grad():
            params[dst].copy_(w)
        copied.append(f"{dst} <- {name}")
        return True

    kv = lambda w: _kv(w, t_kv, c.num_key_value_heads, c.head_dim)  # noqa: E731
    shift = 1.0 if {src.config.get("model_type"), tcfg.get("model_type")} & ZERO_CENTRED_NORMS else 0.0
    norm = lambda w: w + shift  # noqa: E731

    def query(w: torch.Tensor) -> torch.Tensor:  # a gated attention's q_proj: [heads, (query, gate) x hd]
        if w.shape[0] == 2 * t_heads * t_hd:
            return w.unflatten(0, (t_heads, 2, t_hd))[:, 0].flatten(0, 1)
        return w

    for i, (_, j) in enumerate(found[-n:]):
        t = f"{prefix}layers.{j}."
        put(f"layers.{i}.self_attn.q_proj.weight", f"{t}self_attn.q_proj.weight", query)
        put(f"layers.{i}.self_attn.o_proj.weight", f"{t}self_attn.o_proj.weight")
        for p in ("k_proj", "v_proj"):
            put(f"layers.{i}.self_attn.{p}.weight", f"{t}self_attn.{p}.weight", kv)
        for p in ("q_norm", "k_norm"):
            put(f"layers.{i}.self_attn.{p}.weight", f"{t}self_attn.{p}.weight", norm)
        for p in ("gate_proj", "up_proj", "down_proj"):
            put(f"layers.{i}.mlp.{p}.weight", f"{t}mlp.{p}.weight") or put(
                f"layers.{i}.mlp.{p}.weight", f"{t}mlp.shared_expert.{p}.weight"
            )
        for p in ("input_layernorm", "post_attention_layernorm"):
            put(f"layers.{i}.{p}.weight", f"{t}{p}.weight", norm)
    put("norm.weight", f"{prefix}norm.weight", norm)
    K, H = len(c.target_layer_ids), c.hidden_size
    deepest = c.target_layer_ids.index(max(c.target_layer_ids))
    fc = torch.zeros(H, K * H)
    fc[:, deepest * H : (deepest + 1) * H] = torch.eye(H)
    with torch.no_grad():
        params["fc.weight"].copy_(fc)
    copied.append(f"fc.weight <- identity on tap {deepest} (target layer {max(c.target_layer_ids)})")
    return copied
