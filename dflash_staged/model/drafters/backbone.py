"""The DFlash drafter: a few bidirectional Qwen3-style layers conditioned on target features.

Contract (the trainer, the evaluator and :mod:`dflash_staged.weights` rely on it):

* **Features.** ``hidden[t, k]`` is the output of target decoder layer
  ``target_layer_ids[k]`` at token ``t`` (see :mod:`dflash_staged.target`). The K
  taps are concatenated to ``K*H`` in that order, projected by ``fc`` (no bias)
  and normalised by ``hidden_norm``: the *fused context*. The drafter's hidden
  size equals the target's.
* **Block.** For an anchor at position ``a`` of a sequence the block input is the
  target embedding of ``[ids[a], MASK x (B-1)]`` at positions ``a .. a+B-1``.
  Block position ``k`` (1..B-1) predicts ``ids[a+k]`` (no shift) through the final
  ``norm`` and the target LM head. Embedding and LM head are frozen target
  tensors held as buffers: never trained, never saved, except the head of a draft vocabulary
  (``draft_vocab_size``: the target's rows of the vocabulary, ``lm_head.weight``, with ``d2t``;
  :mod:`dflash_staged.model.drafters.vocab`), whose logits are over those rows.
* **Attention (KV injection).** In every layer the keys/values are the layer's own
  ``k_proj``/``v_proj`` of the fused context followed by those of the block;
  ``k_norm`` applies to both; queries come from the block only; RoPE uses
  absolute positions (context ``0..S-1``, block ``a..a+B-1``). Which keys a query
  sees is the rule in :mod:`dflash_staged.model.drafters.attention`: in a
  ``full_attention`` layer the context strictly before the anchor (``0..a-1``) and
  its block; in a ``sliding_attention`` layer (``layer_types``, ``sliding_window``) a window;
  causal or bidirectional within the block per layer (``is_causal``); blocks never see each
  other. The context never enters the residual stream.
* **DFlash2** (``architecture == "dflash2"``): every layer wraps its attention and MLP in the
  in-block convolutions and the drafter has a ``candidate_selector``
  (:mod:`dflash_staged.model.drafters.dflash2.modules`); :attr:`DFlashDrafter.selector` is None for DFlash.
  :meth:`DFlashDrafter.logits` applies the target's logit scaling (``output_multiplier``,
  ``final_logit_softcapping``) for either architecture.
* **Code paths, one function.** :meth:`DFlashDrafter.forward_train` runs many
  anchors of many packed sequences in one pass, with block-sparse ``flex_attention``
  (:mod:`~dflash_staged.model.drafters.flex`, CUDA) or SDPA with dense masks
  (:class:`~dflash_staged.model.drafters.attention.SdpaBlocks`);
  :meth:`DFlashDrafter.draft_block` runs one block against a context cut at its
  anchor, as the reference does at inference, from a :class:`DraftCache` of the
  context's keys/values that decoding extends and crops as the reference's draft
  ``DynamicCache``. They agree to fp32 rounding.
* **Checkpoint.** :class:`DraftModelConfig` is the reference ``config.json``
  (z-lab ``DFlashDraftModel``, in :mod:`dflash_staged.model.drafters.config`); parameter
  names are those of the reference (``layers.{i}.self_attn.q_proj.weight``, ``fc.weight``,
  ``hidden_norm.weight``, ``norm.weight``, ...). Save/load lives in :mod:`dflash_staged.weights`.
* **Precision.** Parameters are created in fp32. On CUDA the trainer runs the
  forward under bf16 autocast; the frozen embedding/head keep the dtype they were
  given (``.to(device)`` moves them, an explicit ``.float()`` would upcast them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.attention import Packing, SdpaBlocks, block_visible, context_visible, sdpa
from dflash_staged.model.drafters.config import (  # noqa: F401 (re-export)
    ARCHITECTURE,
    SLIDING,
    DraftModelConfig,
)
from dflash_staged.model.drafters.layers import (  # noqa: F401 (DraftCache: re-export)
    DraftCache,
    FrozenHead,
    RMSNorm,
    SwiGLU,
    rotate,
)
from dflash_staged.model.target.logits import transform_logits


class Attention(nn.Module):
    def __init__(self, c: DraftModelConfig, layer: int):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.window = c.sliding_window if c.layer_types[layer] == SLIDING else 0  # 0 = full attention
        self.causal = c.layer_causal(layer)
        self.kind = (self.window, self.causal)  # what its mask depends on (block_attention)
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys (k_norm + RoPE) and values of ``x [..., S, H]`` -> two ``[..., S, nkv, hd]``."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.nkv, self.hd)))
        return rotate(k, cos, sin), self.v_proj(x).unflatten(-1, (self.nkv, self.hd))

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate(self.q_norm(self.q_proj(x).unflatten(-1, (self.nh, self.hd))), cos, sin)


class DecoderLayer(nn.Module):
    def __init__(self, c: DraftModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(c, layer)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None  # a family's in-block convolutions (DFlash2)
        c.family.build_layer(self, c)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        """``attend(attn, h) -> [..., B, nh*hd]`` supplies the context keys and the mask; ``x [..., B, H]``
        holds whole blocks (the convolutions run along ``B``)."""
        if self.attention_conv is None:
            x = x + self.self_attn.o_proj(attend(self.self_attn, self.input_layernorm(x)))
            return x + self.mlp(self.post_attention_layernorm(x))
        a, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn.o_proj(attend(self.self_attn, a)), delta)
        m, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(m), delta)


class DFlashDrafter(nn.Module):
    """The DFlash draft model. See the module docstring for the contract."""

    def __init__(
        self,
        dcfg: DraftModelConfig,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        draft_ids: torch.Tensor | None = None,
    ):
        super().__init__()
        c = self.dcfg = dcfg
        V, H = c.vocab_size, c.hidden_size
        for name, w in (("embedding", embed_weight), ("LM head", lm_head_weight)):
            if w.dim() != 2 or w.shape[1] != H or w.shape[0] < V:
                raise DflashError(
                    f"target {name} has shape {tuple(w.shape)}; the drafter config needs "
                    f"[>= {V}, {H}] (vocab_size x hidden_size): wrong target for this drafter?"
                )
        self.block_size = c.block_size
        self.mask_token_id = c.mask_token_id
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        # forward_train recomputes each layer in the backward instead of keeping its activations
        self.activation_checkpointing = False
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.fc = nn.Linear(len(c.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.family = c.family
        self.family.build(self)
        self.register_buffer("embed_weight", embed_weight.detach()[:V], persistent=False)
        self.lm_head = FrozenHead(lm_head_weight.detach()[:V], persistent=False)
        if c.draft_vocab_size:  # placeholder ids until a checkpoint's d2t or the plan's are set
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(V, dtype=torch.long), persistent=False)
            ids = torch.arange(c.draft_vocab_size) if draft_ids is None else draft_ids
            self.set_draft_vocab(ids, lm_head_weight)
        else:  # the whole vocabulary: ``d2t is None`` says so to every caller
            self.register_buffer("d2t", None)
            self.register_buffer("t2d", None, persistent=False)
        inv_freq, self.rope_scale = self._rope_init(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.reset_parameters()

    @staticmethod
    def _rope_init(c: DraftModelConfig) -> tuple[torch.Tensor, float]:
        p = c.rope_parameters
        if p["rope_type"] == "default":
            return 1.0 / (
                p["rope_theta"] ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim)
            ), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS[p["rope_type"]](c.hf_config(), "cpu")
        return inv_freq.float(), float(scale)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Reference (Qwen3PreTrainedModel) init: N(0, 0.02) linear weights (zero biases), unit norm
        weights; then the family's modules their own (DFlash2: identity convolutions, a selector that
        picks the unary argmax)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        self.family.reset_parameters(self)

    # -- the head and the draft vocabulary (dflash_staged.model.drafters.vocab) -------------------
    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The frozen head ``[N, H]``: the target's rows of the draft vocabulary (all ``V`` without one)."""
        return self.lm_head.weight

    @lm_head_weight.setter
    def lm_head_weight(self, w: torch.Tensor) -> None:
        self.lm_head.weight = w

    def set_draft_vocab(self, ids: torch.Tensor, target_head: torch.Tensor) -> None:
        """Make the head the rows ``ids`` (target ids, ``[N]``) of the target's head ``[>= V, H]``."""
        from dflash_staged.model.drafters import vocab

        c = self.dcfg
        ids = vocab.check_ids(ids, c.draft_vocab_size, c.vocab_size, "drafter").to(target_head.device)
        old = self.lm_head.weight
        self.lm_head = FrozenHead(target_head.detach()[ids].to(old.dtype), persistent=True).to(old.device)
        self.d2t = vocab.d2t_of(ids).to(old.device)
        self.t2d = vocab.t2d_of(ids, c.vocab_size).to(old.device)

    def draft_labels(self, labels: torch.Tensor, valid: torch.Tensor):
        """Target-id ``labels`` as draft ids, with the rows whose label lies outside the draft vocabulary
        masked: ``(labels, valid, outside)``, ``outside`` the count of valid rows masked (a tensor)."""
        if self.d2t is None:
            return labels, valid, labels.new_zeros(())
        d = self.t2d.to(labels.device)[labels.long()]
        inside = d >= 0
        return torch.where(inside, d, 0), valid & inside, (valid & ~inside).sum()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids as target ids (unchanged without a draft vocabulary)."""
        if self.d2t is None:
            return draft_ids
        d = draft_ids.long()
        return d + self.d2t.to(d.device)[d]

    @property
    def selector(self):
        """DFlash2's candidate selector (None for other families)."""
        return getattr(self, "candidate_selector", None)

    @property
    def first_row(self) -> int:
        """The block row of the first proposal (the family's layout)."""
        return self.family.first_row

    @property
    def proposals(self) -> int:
        """Proposals a block makes: ``B - 1`` (DFlash: the anchor row predicts nothing) or ``B``."""
        return self.family.proposals(self.block_size)

    # -- shared pieces -------------------------------------------------------------------------
    @property
    def param_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def fuse_context(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target taps ``[..., K, H]`` -> fused context ``[..., H]`` (fc + hidden_norm)."""
        x = hidden.flatten(-2)
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.param_dtype)
        return self.hidden_norm(self.fc(x))

    def _block_input(self, anchor_tokens: torch.Tensor, size: int | None = None) -> torch.Tensor:
        """Embeddings of ``[token, MASK x (B-1)]`` for each anchor token -> ``[A, B, H]`` (``size``: a
        shorter block, as the reference drafts the last one), times ``input_embedding_scale``."""
        ids = torch.full(
            (anchor_tokens.shape[0], size or self.block_size),
            self.mask_token_id,
            dtype=torch.long,
            device=anchor_tokens.device,
        )
        ids[:, 0] = anchor_tokens
        x = F.embedding(ids, self.embed_weight)
        scale = self.dcfg.input_embedding_scale
        return (x if scale == 1.0 else x * scale).to(self.param_dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Target LM head on final-normed drafter outputs, then the logit transform."""
        out = F.linear(h.to(self.lm_head_weight.dtype), self.lm_head_weight)
        return transform_logits(out, self.dcfg.output_multiplier, self.dcfg.final_logit_softcapping)

    # -- inference: one block, context cut at the anchor ---------------------------------------
    def extend_cache(self, cache: DraftCache, fused: torch.Tensor) -> DraftCache:
        """Append the keys/values of fused context ``[n, H]`` at positions ``cache.length ..``."""
        S = cache.length
        cos, sin = self._rope(torch.arange(S, S + fused.shape[0], device=fused.device), fused.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(fused, cos, sin)
            if i < len(cache.k):
                cache.k[i], cache.v[i] = torch.cat([cache.k[i], k]), torch.cat([cache.v[i], v])
            else:
                cache.k.append(k)
                cache.v.append(v)
        return cache

    def draft_block(
        self,
        context_hidden: torch.Tensor | None,
        anchor_token,
        anchor_pos: int | None = None,
        fused: bool = False,
        cache: DraftCache | None = None,
        return_hidden: bool = False,
        size: int | None = None,
        state: dict | None = None,
    ):
        """Logits ``[P, V]`` of the block's proposal rows (rows ``first_row..B-1``: ``P = B-1`` for
        DFlash, ``B`` for DSpark) of one anchor (with ``return_hidden``, also their final-normed states
        ``[P, H]``, which a family's walk needs; ``state``: the family's per-layer hook reads and records
        there, see :mod:`~dflash_staged.model.drafters.family`). ``size`` (2..B) runs a
        shorter block, ``[anchor, MASK x (size-1)]``, as the reference drafts the last block before
        ``max_new_tokens``: with bidirectional attention its drafts differ from the full block's.

        The context is ``cache`` (positions ``0..cache.length-1``) followed by
        ``context_hidden``: the target taps ``[S, K, H]`` (or, with ``fused=True``, the fused
        context ``[S, H]``), which are appended to ``cache`` when one is given. All of it lies
        strictly before the anchor; ``anchor_pos`` defaults to its end. ``anchor_token`` is
        the token at the anchor (already committed).
        """
        cache = cache if cache is not None else DraftCache()
        if context_hidden is not None and context_hidden.shape[0]:
            self.extend_cache(cache, context_hidden if fused else self.fuse_context(context_hidden))
        S = cache.length
        a = S if anchor_pos is None else int(anchor_pos)
        dev = self.fc.weight.device
        B = int(size or self.block_size)
        tok = torch.as_tensor(anchor_token, dtype=torch.long, device=dev).reshape(1)
        x = self._block_input(tok, B)[0]  # [B, H]
        cos_b, sin_b = self._rope(torch.arange(a, a + B, device=dev), x.dtype)
        q_off = torch.arange(B, device=dev)[:, None]
        layers = iter(range(len(self.layers)))

        def attend(attn: Attention, h: torch.Tensor) -> torch.Tensor:
            i = next(layers)
            lo = max(0, a - attn.window + 1) if attn.window else 0
            k_c, v_c = cache.k[i][lo:S], cache.v[i][lo:S]
            k_b, v_b = attn.kv(h, cos_b, sin_b)
            mask = None
            if attn.window or attn.causal or a < S:
                key_pos = torch.arange(lo, S, device=dev)[None]
                mask = torch.cat(
                    [
                        context_visible(key_pos, a, q_off, attn.window).expand(B, -1),
                        block_visible(torch.arange(B, device=dev)[None], q_off, attn.window, attn.causal),
                    ],
                    1,
                )
            q = attn.q(h, cos_b, sin_b).transpose(0, 1)  # [nh, B, hd]
            k = torch.cat([k_c, k_b]).transpose(0, 1)
            v = torch.cat([v_c, v_b]).transpose(0, 1)
            return sdpa(q, k, v, mask).transpose(0, 1).flatten(-2)

        if not cache.k:  # no context at all: empty per-layer caches
            cache.k = [x.new_zeros(0, self.dcfg.num_key_value_heads, self.dcfg.head_dim) for _ in self.layers]
            cache.v = [t.clone() for t in cache.k]
        state = {} if state is None else state
        state.setdefault("block_tokens", torch.cat([tok, tok.new_full((B - 1,), self.mask_token_id)]))
        for i, layer in enumerate(self.layers):
            x = self.family.after_layer(self, i, layer(x, attend), state)
        h = self.norm(x)[self.first_row :]
        return (self.logits(h), h) if return_hidden else self.logits(h)

    # -- training: many anchors of many packed sequences in one pass ---------------------------
    def forward_train(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        anchors: torch.Tensor,
        attention: str | Callable = "sdpa",
        state: dict | None = None,
    ) -> torch.Tensor:
        """Final-normed block states ``[A, B, H]`` for every anchor (LM head not applied).

        ``hidden [T, K, H]`` and ``input_ids [T]`` are packed sequences delimited by
        ``cu_seqlens [N+1]``; ``anchors [A]`` are packed token indices, in any order.
        Row ``i`` of the result belongs to ``anchors[i]``. A block may run past the end
        of its sequence (its positions just have no label). ``attention``: ``"sdpa"``,
        ``"flex"`` (see :func:`~dflash_staged.model.drafters.flex.resolve_attention`), or a
        callable ``(Packing, kinds) -> blocks`` (benchmarks). Two host syncs (sizes, chunk bounds).
        ``state`` (a family's objective): its ``block_tokens [A, B]`` and ``replace [A]`` are in
        ``anchors``' order; what the family's per-layer hook records under ``state["record"]`` (tensors,
        or lists of them, with the anchors first) is returned in that order too.
        """
        dev = hidden.device
        A, B, T = anchors.shape[0], self.block_size, hidden.shape[0]
        ctx = self.fuse_context(hidden)  # [T, H]
        if A == 0:
            return ctx.new_zeros(0, B, ctx.shape[-1])
        pk = Packing.of(cu_seqlens.to(dev), anchors.to(device=dev, dtype=torch.long), B, T)
        x = self._block_input(input_ids.to(dev)[pk.srt])  # [A, B, H]
        cos_c, sin_c = self._rope(pk.pos_of_tok, x.dtype)
        cos_b, sin_b = self._rope(pk.a_pos[:, None] + torch.arange(B, device=dev), x.dtype)
        kinds = {layer.self_attn.kind for layer in self.layers}
        if callable(attention):
            blocks = attention(pk, kinds)
        elif attention == "flex":
            from dflash_staged.model.drafters.flex import FlexBlocks

            blocks = FlexBlocks(pk, kinds)
        elif attention == "sdpa":
            blocks = SdpaBlocks(pk, self.dcfg.num_attention_heads, kinds)
        else:
            raise DflashError(f"attention={attention!r}: use 'sdpa' or 'flex'")

        def attend(attn: Attention, h: torch.Tensor) -> torch.Tensor:
            k_c, v_c = attn.kv(ctx, cos_c, sin_c)  # [T, nkv, hd]
            k_b, v_b = attn.kv(h, cos_b, sin_b)  # [A, B, nkv, hd]
            return blocks(attn.q(h, cos_b, sin_b), k_c, v_c, k_b, v_b, attn.kind).flatten(-2)

        state = {} if state is None else state
        for k in ("block_tokens", "replace"):
            if state.get(k) is not None:
                state[k] = state[k].to(dev)[pk.perm]
        record = state.setdefault("record", {})
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            x = checkpoint(layer, x, attend, use_reentrant=False) if recompute else layer(x, attend)
            x = self.family.after_layer(self, i, x, state)
        back = torch.argsort(pk.perm)
        for k, v in record.items():
            record[k] = [t[back] for t in v] if isinstance(v, list) else v[back]
        return self.norm(x)[back]
