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
  tensors held as non-persistent buffers: never trained, never saved.
* **Attention (KV injection).** In every layer the keys/values are the layer's own
  ``k_proj``/``v_proj`` of the fused context followed by those of the block;
  ``k_norm`` applies to both; queries come from the block only; RoPE uses
  absolute positions (context ``0..S-1``, block ``a..a+B-1``). A block sees the
  context strictly before its anchor (``0..a-1``) and its whole block
  (bidirectional); blocks never see each other. The context never enters the
  residual stream.
* **Two code paths, one function.** :meth:`DFlashDrafter.forward_train` runs
  many anchors of many packed sequences in one pass with a block mask;
  :meth:`DFlashDrafter.draft_block` runs one block against a context cut at its
  anchor, as the reference does at inference. They agree to fp32 rounding.
* **Checkpoint.** :class:`DraftModelConfig` is the reference ``config.json``
  (z-lab ``DFlashDraftModel``, in :mod:`dflash_staged.draft_config`); parameter
  names are those of the reference (``layers.{i}.self_attn.q_proj.weight``, ``fc.weight``, ``hidden_norm.weight``,
  ``norm.weight``, ...). Save/load lives in :mod:`dflash_staged.weights`.
* **Precision.** Parameters are created in fp32. On CUDA the trainer runs the
  forward under bf16 autocast; the frozen embedding/head keep the dtype they were
  given (``.to(device)`` moves them, an explicit ``.float()`` would upcast them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_staged.model.draft_config import ARCHITECTURE, DraftModelConfig  # noqa: F401 (re-export)
from dflash_staged.errors import DflashError

# Elements of one attention mask chunk in forward_train (bounds memory on CPU and GPU).
ATTN_CHUNK_ELEMS = 1 << 25


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (half-split convention). x [..., heads, hd]; cos/sin [..., hd]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, c: DraftModelConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys (k_norm + RoPE) and values of ``x [..., S, H]`` -> two ``[..., S, nkv, hd]``."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.nkv, self.hd)))
        return _rotate(k, cos, sin), self.v_proj(x).unflatten(-1, (self.nkv, self.hd))

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return _rotate(self.q_norm(self.q_proj(x).unflatten(-1, (self.nh, self.hd))), cos, sin)


class DecoderLayer(nn.Module):
    def __init__(self, c: DraftModelConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        """``attend(attn, h) -> [..., B, nh*hd]`` supplies the context keys and the mask."""
        x = x + self.self_attn.o_proj(attend(self.self_attn, self.input_layernorm(x)))
        return x + self.mlp(self.post_attention_layernorm(x))


def _gqa(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[..., nkv, S, hd]`` -> ``[..., nkv*groups, S, hd]`` (kv head i serves q heads i*g..)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


class DFlashDrafter(nn.Module):
    """The DFlash draft model. See the module docstring for the contract."""

    def __init__(self, dcfg: DraftModelConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        c = self.dcfg = dcfg
        V, H = c.vocab_size, c.hidden_size
        for name, w in (("embedding", embed_weight), ("LM head", lm_head_weight)):
            if w.dim() != 2 or w.shape[1] != H or w.shape[0] < V:
                raise DflashError(f"target {name} has shape {tuple(w.shape)}; the drafter config needs "
                                  f"[>= {V}, {H}] (vocab_size x hidden_size): wrong target for this drafter?")
        self.block_size = c.block_size
        self.mask_token_id = c.mask_token_id
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.fc = nn.Linear(len(c.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.register_buffer("embed_weight", embed_weight.detach()[:V], persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach()[:V], persistent=False)
        inv_freq, self.rope_scale = self._rope_init(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.reset_parameters()

    @staticmethod
    def _rope_init(c: DraftModelConfig) -> tuple[torch.Tensor, float]:
        p = c.rope_parameters
        if p["rope_type"] == "default":
            return 1.0 / (p["rope_theta"] ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, scale = ROPE_INIT_FUNCTIONS[p["rope_type"]](c.hf_config(), "cpu")
        return inv_freq.float(), float(scale)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Reference (Qwen3PreTrainedModel) init: N(0, 0.02) linear weights, unit norm weights."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

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

    def _block_input(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``[token, MASK x (B-1)]`` for each anchor token -> ``[A, B, H]``."""
        ids = torch.full((anchor_tokens.shape[0], self.block_size), self.mask_token_id,
                         dtype=torch.long, device=anchor_tokens.device)
        ids[:, 0] = anchor_tokens
        return F.embedding(ids, self.embed_weight).to(self.param_dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Target LM head on drafter outputs (already through the final ``norm``)."""
        return F.linear(h.to(self.lm_head_weight.dtype), self.lm_head_weight)

    # -- inference: one block, context cut at the anchor ---------------------------------------
    def draft_block(self, context_hidden: torch.Tensor, anchor_token, anchor_pos: int | None = None,
                    fused: bool = False) -> torch.Tensor:
        """Logits ``[B-1, V]`` for block offsets 1..B-1 of one anchor.

        ``context_hidden`` holds the target taps ``[S, K, H]`` (or, with ``fused=True``,
        the fused context ``[S, H]``) of positions ``0..S-1``, all strictly before the
        anchor; ``anchor_pos`` defaults to ``S``. ``anchor_token`` is the token at the
        anchor (already committed).
        """
        ctx = context_hidden if fused else self.fuse_context(context_hidden)
        S = ctx.shape[0]
        a = S if anchor_pos is None else int(anchor_pos)
        dev = ctx.device
        tok = torch.as_tensor(anchor_token, dtype=torch.long, device=dev).reshape(1)
        x = self._block_input(tok)[0]  # [B, H]
        cos_c, sin_c = self._rope(torch.arange(S, device=dev), x.dtype)
        cos_b, sin_b = self._rope(torch.arange(a, a + self.block_size, device=dev), x.dtype)
        groups = self.dcfg.num_attention_heads // self.dcfg.num_key_value_heads

        def attend(attn: Attention, h: torch.Tensor) -> torch.Tensor:
            k_c, v_c = attn.kv(ctx, cos_c, sin_c)
            k_b, v_b = attn.kv(h, cos_b, sin_b)
            q = attn.q(h, cos_b, sin_b).transpose(0, 1)  # [nh, B, hd]
            k = _gqa(torch.cat([k_c, k_b]).transpose(0, 1), groups)
            v = _gqa(torch.cat([v_c, v_b]).transpose(0, 1), groups)
            q, k, v = (t.to(v.dtype) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v).transpose(0, 1).flatten(-2)

        for layer in self.layers:
            x = layer(x, attend)
        return self.logits(self.norm(x)[1:])

    # -- training: many anchors of many packed sequences in one pass ---------------------------
    def _anchor_chunk(self, N: int, M: int, Lmax: int, dev: torch.device) -> int:
        """Anchors per sequence in one attention call: bounds the mask (CUDA kernels do not
        materialise scores) or the scores (CPU math path) to ``ATTN_CHUNK_ELEMS``, and keeps
        the wasted block-vs-other-blocks part no larger than the context part."""
        B = self.block_size
        per_key = N * (1 if dev.type == "cuda" else self.dcfg.num_attention_heads)
        c = max(1, min(M, max(Lmax, 16 * B) // B))
        while c > 1 and per_key * c * B * (Lmax + c * B) > ATTN_CHUNK_ELEMS:
            c = (c + 1) // 2
        return c

    def forward_train(self, hidden: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                      anchors: torch.Tensor) -> torch.Tensor:
        """Final-normed block states ``[A, B, H]`` for every anchor (LM head not applied).

        ``hidden [T, K, H]`` and ``input_ids [T]`` are packed sequences delimited by
        ``cu_seqlens [N+1]``; ``anchors [A]`` are packed token indices, in any order.
        Row ``i`` of the result belongs to ``anchors[i]``. A block may run past the end
        of its sequence (its positions just have no label). One host sync (sizes).
        """
        dev = hidden.device
        A, B, T = anchors.shape[0], self.block_size, hidden.shape[0]
        cu = cu_seqlens.to(device=dev, dtype=torch.long)
        anchors = anchors.to(device=dev, dtype=torch.long)
        ctx = self.fuse_context(hidden)  # [T, H]
        if A == 0:
            return ctx.new_zeros(0, B, ctx.shape[-1])
        # Layout: sequences padded to Lmax (context) and to M anchors each (queries).
        N = cu.numel() - 1
        lengths = cu[1:] - cu[:-1]
        seq_of_tok = torch.repeat_interleave(torch.arange(N, device=dev), lengths, output_size=T)
        pos_of_tok = torch.arange(T, device=dev) - cu[seq_of_tok]
        srt, perm = anchors.sort()
        a_seq = seq_of_tok[srt]
        a_pos = pos_of_tok[srt]
        counts = torch.bincount(a_seq, minlength=N)
        first = torch.cumsum(counts, 0) - counts
        a_slot = torch.arange(A, device=dev) - first[a_seq]
        Lmax, M = (int(v) for v in torch.stack([lengths.max(), counts.max()]).tolist())
        ctx_idx = (cu[:-1, None] + torch.arange(Lmax, device=dev)).clamp(max=T - 1)  # [N, Lmax]
        key_pos = torch.arange(Lmax, device=dev)
        anchor_pad = torch.zeros(N, M, dtype=torch.long, device=dev)  # padding anchors see no context
        anchor_pad[a_seq, a_slot] = a_pos

        x = self._block_input(input_ids.to(dev)[srt])  # [A, B, H]
        cos_c, sin_c = self._rope(pos_of_tok, x.dtype)
        cos_b, sin_b = self._rope(a_pos[:, None] + torch.arange(B, device=dev), x.dtype)
        nh, nkv, hd = self.dcfg.num_attention_heads, self.dcfg.num_key_value_heads, self.dcfg.head_dim
        groups = nh // nkv
        chunk = self._anchor_chunk(N, M, Lmax, dev)
        blk_same = torch.eye(chunk, dtype=torch.bool, device=dev).repeat_interleave(B, 0).repeat_interleave(B, 1)

        def attend(attn: Attention, h: torch.Tensor) -> torch.Tensor:
            k_c, v_c = attn.kv(ctx, cos_c, sin_c)  # [T, nkv, hd]
            k_c, v_c = k_c[ctx_idx], v_c[ctx_idx]  # [N, Lmax, nkv, hd]
            k_b, v_b = attn.kv(h, cos_b, sin_b)  # [A, B, nkv, hd]
            q = attn.q(h, cos_b, sin_b)  # [A, B, nh, hd]

            def pad(t: torch.Tensor) -> torch.Tensor:
                out = t.new_zeros(N, M, *t.shape[1:])
                out[a_seq, a_slot] = t
                return out

            q, k_b, v_b = pad(q), pad(k_b), pad(v_b)  # [N, M, B, heads, hd]
            outs = []
            for m0 in range(0, M, chunk):
                c = min(chunk, M - m0)
                qc = q[:, m0:m0 + c].flatten(1, 2).transpose(1, 2)  # [N, nh, cB, hd]
                kc = torch.cat([k_c, k_b[:, m0:m0 + c].flatten(1, 2)], 1).transpose(1, 2)
                vc = torch.cat([v_c, v_b[:, m0:m0 + c].flatten(1, 2)], 1).transpose(1, 2)
                see_ctx = key_pos[None, None, :] < anchor_pad[:, m0:m0 + c, None]  # [N, c, Lmax]
                mask = torch.cat([see_ctx.repeat_interleave(B, 1),
                                  blk_same[:c * B, :c * B].expand(N, -1, -1)], 2)[:, None]
                qc, kc, vc = (t.to(vc.dtype) for t in (qc, _gqa(kc, groups), _gqa(vc, groups)))
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask)
                outs.append(o.transpose(1, 2).unflatten(1, (c, B)))  # [N, c, B, nh, hd]
            o = torch.cat(outs, 1)[a_seq, a_slot]  # [A, B, nh, hd]
            return o.flatten(-2)

        for layer in self.layers:
            x = layer(x, attend)
        out = self.norm(x)
        return out[torch.argsort(perm)]
