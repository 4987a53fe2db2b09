"""The DFlash attention rule, and the dense-mask (SDPA) way :meth:`DFlashDrafter.forward_train` runs it.

The rule, written once (every mask of every code path, training or inference, comes from
:func:`context_visible` and :func:`block_visible`): the query at block offset ``q`` (0..B-1)
of the anchor at position ``a`` of a sequence attends to

* context position ``p`` of its own sequence iff ``p < a`` and, in a ``sliding_attention``
  layer of window ``W``, ``p >= a + q - (W - 1)``;
* offset ``k`` of its own block: iff ``k <= q`` in a *causal* layer, always in a bidirectional
  one; and in a sliding layer only within the window, ``|q - k| < W``;
* nothing else: no other block, no other packed sequence, no padding.

Which layers are causal (a layer's *kind* is ``(window, causal)``, window 0 = full attention):
the drafter config's ``is_causal`` when it is set, for every layer; otherwise sliding layers
causal and full layers bidirectional. That is the reference's rule (z-lab ``dflash/model.py``:
``is_causal`` from the config when present, else ``layer_type == "sliding_attention"``) and
SGLang's since its PR #34524. Without ``is_causal`` a sliding layer is therefore a causal
sliding window of ``W`` positions that counts the query's own position (Hugging Face's
``sliding_window``), over the context cut at the anchor followed by the block, as SpecForge
trains it and SGLang (``window_left = W - 1``) and vLLM serve it; the released DFlash2 drafters
set ``is_causal: false``: every layer sees its whole block, a sliding one within ``|q - k| < W``
over [context | block], the reference's bidirectional sliding mask.

:class:`Packing` is the geometry of one training pass (packed sequences, anchors in any
order); :class:`SdpaBlocks` evaluates the rule with ``scaled_dot_product_attention`` and a
boolean mask, sequences padded to the longest and anchors in chunks, each chunk's context
keys cut to what its anchors can see (``[0, last anchor)``, and in a sliding layer from
the first anchor's window start).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Elements of one attention mask chunk in the SDPA path (bounds memory on CPU and GPU).
ATTN_CHUNK_ELEMS = 1 << 25


def context_visible(key_pos, anchor, q_off, window: int):
    """Whether the query at offset ``q_off`` of the block anchored at ``anchor`` sees context
    position ``key_pos`` of its sequence (tensors broadcast; ``window`` 0 = full attention)."""
    vis = key_pos < anchor
    if window:
        vis = vis & (key_pos >= anchor + q_off - (window - 1))
    return vis


def block_visible(key_off, q_off, window: int, causal: bool | None = None):
    """Whether the query at offset ``q_off`` sees offset ``key_off`` of its own block (offsets >= 0);
    ``causal`` None = the default rule (sliding layers causal)."""
    causal = bool(window) if causal is None else causal
    vis = key_off <= q_off if causal else key_off + q_off >= 0
    if window:
        vis = vis & (q_off - key_off < window) & (key_off - q_off < window)
    return vis


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` over ``[..., heads, L, hd]`` with GQA (``k``/``v`` may have
    fewer heads): ``enable_gqa`` on CPU, repeated K/V elsewhere (CUDA's masked kernels lack GQA)."""
    q, k = q.to(v.dtype), k.to(v.dtype)
    groups = q.shape[-3] // k.shape[-3]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if q.device.type == "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    k, v = (t.repeat_interleave(groups, dim=-3) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@dataclass
class Packing:
    """Where every token and anchor of a training pass sits (computed once per pass)."""

    N: int  # sequences
    A: int  # anchors
    B: int  # block size
    T: int  # packed tokens
    Lmax: int  # longest sequence
    M: int  # most anchors of one sequence
    cu: torch.Tensor  # [N+1]
    seq_of_tok: torch.Tensor  # [T]
    pos_of_tok: torch.Tensor  # [T] position inside its sequence
    srt: torch.Tensor  # [A] anchors (packed indices), sorted
    perm: torch.Tensor  # [A] srt = anchors[perm]
    a_seq: torch.Tensor  # [A] sequence of each sorted anchor
    a_pos: torch.Tensor  # [A] its position inside the sequence
    a_slot: torch.Tensor  # [A] its rank among its sequence's anchors
    counts: torch.Tensor  # [N] anchors per sequence

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, anchors: torch.Tensor, block_size: int, T: int) -> Packing:
        """One host sync (the sizes)."""
        dev = anchors.device
        cu = cu_seqlens.to(device=dev, dtype=torch.long)
        N = cu.numel() - 1
        lengths = cu[1:] - cu[:-1]
        seq_of_tok = torch.repeat_interleave(torch.arange(N, device=dev), lengths, output_size=T)
        pos_of_tok = torch.arange(T, device=dev) - cu[seq_of_tok]
        srt, perm = anchors.sort()
        a_seq = seq_of_tok[srt]
        counts = torch.bincount(a_seq, minlength=N)
        first = torch.cumsum(counts, 0) - counts
        a_slot = torch.arange(anchors.numel(), device=dev) - first[a_seq]
        Lmax, M = (int(v) for v in torch.stack([lengths.max(), counts.max()]).tolist())
        return cls(
            N=N,
            A=anchors.numel(),
            B=block_size,
            T=T,
            Lmax=Lmax,
            M=M,
            cu=cu,
            seq_of_tok=seq_of_tok,
            pos_of_tok=pos_of_tok,
            srt=srt,
            perm=perm,
            a_seq=a_seq,
            a_pos=pos_of_tok[srt],
            a_slot=a_slot,
            counts=counts,
        )

    def needed_pairs(self, kind: tuple[int, bool] = (0, False)) -> int:
        """Query-key pairs the rule lets through in a layer of ``kind`` (the work an exact kernel must do)."""
        window, causal = kind
        q = torch.arange(self.B, device=self.srt.device)
        ctx = self.a_pos[:, None].expand(-1, self.B)
        if window:
            ctx = torch.minimum(ctx, (window - 1 - q)[None].clamp(min=0).expand_as(ctx))
        blk = block_visible(q[None], q[:, None], window, causal).sum(1)[None].expand_as(ctx)
        return int((ctx + blk).sum())


class SdpaBlocks:
    """The rule evaluated with SDPA and dense boolean masks, anchors chunked, keys cut per chunk."""

    def __init__(self, pk: Packing, nheads: int, kinds: set[tuple[int, bool]], cut_keys: bool = True):
        self.pk = pk
        dev = pk.srt.device
        self.chunk = anchor_chunk(pk.N, pk.M, pk.Lmax, pk.B, nheads, dev)
        self.anchor_pad = torch.zeros(
            pk.N, pk.M, dtype=torch.long, device=dev
        )  # padding anchors see no context
        self.anchor_pad[pk.a_seq, pk.a_slot] = pk.a_pos
        self.bounds = self._bounds(sorted({w for w, _ in kinds}), cut_keys)
        self.computed = 0  # query-key pairs handed to SDPA (for the benchmark)
        self._chunks: dict[tuple[tuple[int, bool], int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _bounds(self, windows: list[int], cut_keys: bool) -> dict[int, list[tuple[int, int]]]:
        """Per window, each chunk's context key range ``[lo, hi)`` (one host sync)."""
        pk, c = self.pk, self.chunk
        n_chunks = -(-pk.M // c)
        if not cut_keys:
            return {w: [(0, pk.Lmax)] * n_chunks for w in windows}
        pad = n_chunks * c - pk.M
        ap = F.pad(self.anchor_pad, (0, pad)).view(pk.N, n_chunks, c)
        valid = F.pad(torch.arange(pk.M, device=ap.device)[None] < pk.counts[:, None], (0, pad)).view(
            pk.N, n_chunks, c
        )
        rows = [ap.amax(dim=(0, 2))]
        big = torch.iinfo(torch.long).max
        for w in windows:
            if w:
                rows.append((torch.where(valid, ap, big).amin(dim=(0, 2)) - (w - 1)).clamp(min=0))
        vals = torch.stack(rows).tolist()
        hi, lows = vals[0], iter(vals[1:])
        return {w: list(zip(next(lows) if w else [0] * n_chunks, hi)) for w in windows}

    def _chunk(self, kind: tuple[int, bool], j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``j``'s context key indices ``[N, Lc]`` and mask ``[N, 1, cB, Lc + cB]``, built once
        per pass and shared by the layers of a kind."""
        window, causal = kind
        if (kind, j) not in self._chunks:
            pk, B = self.pk, self.pk.B
            dev = pk.srt.device
            lo, hi = self.bounds[window][j]
            m0 = j * self.chunk
            c = min(self.chunk, pk.M - m0)
            key_pos = torch.arange(lo, hi, device=dev)
            idx = (pk.cu[:-1, None] + key_pos).clamp(max=pk.T - 1)
            anchor = self.anchor_pad[:, m0 : m0 + c, None, None]  # [N, c, 1, 1]
            offs = torch.arange(B, device=dev)[:, None]
            see_ctx = context_visible(key_pos, anchor, offs, window).expand(-1, -1, B, -1).flatten(1, 2)
            blk = torch.arange(c * B, device=dev)
            see_blk = (blk[:, None] // B == blk[None] // B) & block_visible(
                blk[None] % B, blk[:, None] % B, window, causal
            )
            self._chunks[(kind, j)] = idx, torch.cat([see_ctx, see_blk.expand(pk.N, -1, -1)], 2)[:, None]
        return self._chunks[(kind, j)]

    def __call__(self, q, k_c, v_c, k_b, v_b, kind: tuple[int, bool]) -> torch.Tensor:
        """``q [A, B, nh, hd]``, context ``k_c/v_c [T, nkv, hd]``, block ``k_b/v_b [A, B, nkv, hd]``
        (anchors sorted), in a layer of ``kind`` ``(window, causal)`` -> ``[A, B, nh, hd]``."""
        pk, B = self.pk, self.pk.B

        def pad(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(pk.N, pk.M, *t.shape[1:])
            out[pk.a_seq, pk.a_slot] = t
            return out

        q, k_b, v_b = pad(q), pad(k_b), pad(v_b)  # [N, M, B, heads, hd]
        outs = []
        for j, (lo, hi) in enumerate(self.bounds[kind[0]]):
            m0 = j * self.chunk
            c = min(self.chunk, pk.M - m0)
            idx, mask = self._chunk(kind, j)
            qc = q[:, m0 : m0 + c].flatten(1, 2).transpose(1, 2)  # [N, nh, cB, hd]
            kc = torch.cat([k_c[idx], k_b[:, m0 : m0 + c].flatten(1, 2)], 1).transpose(1, 2)
            vc = torch.cat([v_c[idx], v_b[:, m0 : m0 + c].flatten(1, 2)], 1).transpose(1, 2)
            self.computed += pk.N * c * B * (hi - lo + c * B)
            o = sdpa(qc, kc, vc, mask)
            outs.append(o.transpose(1, 2).unflatten(1, (c, B)))  # [N, c, B, nh, hd]
        return torch.cat(outs, 1)[pk.a_seq, pk.a_slot]  # [A, B, nh, hd]


def anchor_chunk(N: int, M: int, Lmax: int, B: int, nheads: int, dev: torch.device) -> int:
    """Anchors per sequence in one SDPA call. Each query of a chunk of ``c`` anchors is scored
    against all ``c*B`` block keys of the chunk (``B`` of them visible), so ``c*B`` is held to a
    quarter of the longest sequence (at least 4 anchors): with each chunk's keys cut to its
    anchors, fine chunks waste little (finer still measured no faster on CPU). The mask (CUDA kernels
    do not materialise scores) or the scores (CPU math path) of one call stay within
    ``ATTN_CHUNK_ELEMS``."""
    per_key = N * (1 if dev.type == "cuda" else nheads)
    c = max(1, min(M, max(4, Lmax // (4 * B))))
    while c > 1 and per_key * c * B * (Lmax + c * B) > ATTN_CHUNK_ELEMS:
        c = (c + 1) // 2
    return c
