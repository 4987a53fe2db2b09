"""DFlash2's two modules on top of the DFlash backbone: in-block convolutions and the candidate selector.

Contract (the checkpoint format is z-lab's ``DFlash2DraftModel``; SGLang and vLLM load it):

* **In-block convolution** (:class:`GroupedConv`; each decoder layer has ``attention_conv`` and
  ``mlp_conv``). ``base_kernel [2, K, H]`` (side, tap, channel) and ``kernel_projection``
  (``H -> 2*K*H/G``, no bias, outputs laid out (side, tap, group)). For a sublayer with normed input
  ``a`` (rows ``[..., B, H]``, one block per ``B`` rows): :meth:`GroupedConv.prepare` computes
  ``delta = kernel_projection(a)`` and returns side 0's convolution of ``a`` (the sublayer's input)
  with side 1's kernel; :meth:`GroupedConv.finish` convolves the sublayer's output with it, before
  the residual add. Side ``s`` at row ``i``, channel ``c``:
  ``sum_t (base[s, t, c] + delta[i, s, t, c // G]) * z[i - t, c]``, with ``z[i - t] = 0`` before the
  block's first row: causal, and never across a block start. Both sides' coefficients come from the
  sublayer's normed *input*. Initialised as the identity (tap 0 = 1, the rest and the projection 0),
  so a new DFlash2 computes exactly DFlash v1.
* **Candidate selector** (:class:`CandidateSelector`, ``candidate_selector.*``): the predecessor
  and successor codebooks ``[V, R]`` are bare parameters (checkpoint keys without ``.weight``) and
  ``hidden_projection`` is ``H -> R``, no bias. At block offset ``j`` (1..B-1) with final-normed
  hidden state ``h_j`` and unary logits ``u_j`` (the head's, after the drafter's logit transform),
  the candidates are the top ``K = selector_top_k`` tokens of ``u_j`` and a candidate ``c`` after
  predecessor ``p`` scores ``u_j(c) + sum_r A[p, r] * P(h_j)[r] * Bk[c, r]``. Offset 1's
  predecessor is the anchor token. Initialised with ``A``, ``P`` ~ N(0, 0.02) and ``Bk = 0``:
  a new selector picks the unary argmax, i.e. DFlash.
* **Walk** (:meth:`CandidateSelector.walk`, inference): left to right, each offset's choice is the
  next one's predecessor; greedy = argmax of the scores, at temperature ``T > 0`` a sample from
  ``softmax(scores / T)`` over the K candidates, which is returned as the proposal distribution
  for lossless rejection sampling. Scores are computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def convolve(z: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group: int) -> torch.Tensor:
    """One side of the convolution: ``z [..., B, H]``, ``base [K, H]``, ``delta [..., B, K, H/G]``."""
    out = None
    for t in range(base.shape[0]):
        zt = z if t == 0 else F.pad(z[..., :-t, :], (0, 0, t, 0))
        term = (base[t].to(z.dtype) + delta[..., t, :].repeat_interleave(group, -1).to(z.dtype)) * zt
        out = term if out is None else out + term
    return out


class GroupedConv(nn.Module):
    """The grouped, dynamic, depthwise, causal in-block convolution (see the module contract)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size), bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 of both sides 1, every other coefficient 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(side 0's convolution of the normed input ``a [..., B, H]``, side 1's coefficients)."""
        delta = self.kernel_projection(a).unflatten(-1, (2, self.kernel_size, -1))
        return convolve(a, self.base_kernel[0], delta[..., 0, :, :], self.group_size), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Side 1's convolution of the sublayer's output ``y [..., B, H]``."""
        return convolve(y, self.base_kernel[1], delta, self.group_size)


class CandidateSelector(nn.Module):
    """Top-k candidates rescored with a low-rank predecessor term (see the module contract)."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.hidden_projection.weight, std=std)
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.zeros_(self.successor_codebook)

    def gate(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``A[prev] * P(hidden)`` in fp32: ``prev [...]``, ``hidden [..., H]`` -> ``[..., R]``."""
        proj = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).float()
        return self.predecessor_codebook[prev].float() * proj

    def scores(self, unary: torch.Tensor, cand: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Scores ``[..., K]`` of candidates ``cand [..., K]`` with unary logits ``unary [..., K]``."""
        succ = self.successor_codebook[cand].float()  # [..., K, R]
        return unary.float() + (succ @ gate.unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def walk(
        self,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        anchor_token,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The left-to-right walk over offsets 1..B-1: ``logits [..., L, V]``, ``hidden [..., L, H]``,
        the anchor token(s) ``[...]`` -> (tokens ``[..., L]``, candidates ``[..., L, K]``, the
        distribution each choice was drawn from ``[..., L, K]``: one-hot when greedy). As the reference
        serves it: the candidates from ``topk(sorted=False)`` and the scores in the logits' dtype, so
        a tie between scores goes to the first candidate in that order (bf16 serving: see
        docs/dflash2.md)."""
        unary, cand = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1, sorted=False)
        return self.walk_candidates(unary, cand, hidden, anchor_token, temperature, generator, fp32=False)

    @torch.no_grad()
    def walk_candidates(
        self,
        unary: torch.Tensor,
        cand: torch.Tensor,
        hidden: torch.Tensor,
        anchor_token,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        fp32: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`walk` from the candidates ``cand [..., L, K]`` and their unary logits already chosen;
        the scores in fp32 (training's metrics), or (``fp32=False``) in ``unary``'s dtype as served."""
        dt = torch.float32 if fp32 else unary.dtype
        proj = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).to(dt)
        prev = torch.as_tensor(anchor_token, device=unary.device).long().expand(unary.shape[:-2])
        tokens, probs = [], []
        for j in range(unary.shape[-2]):
            gate = self.predecessor_codebook[prev].to(dt) * proj[..., j, :]
            succ = self.successor_codebook[cand[..., j, :]].to(dt)  # [..., K, R]
            s = unary[..., j, :].to(dt) + (succ @ gate.unsqueeze(-1)).squeeze(-1)
            if temperature > 0:
                q = torch.softmax(s.float() / temperature, dim=-1)
                flat = q.reshape(-1, q.shape[-1])
                idx = torch.multinomial(flat, 1, generator=generator).reshape(q.shape[:-1])
            else:
                idx = s.argmax(-1)  # the first of equal scores, as the reference's argmax
                q = F.one_hot(idx, s.shape[-1]).float()
            prev = cand[..., j, :].gather(-1, idx[..., None])[..., 0]
            tokens.append(prev)
            probs.append(q)
        return torch.stack(tokens, -1), cand, torch.stack(probs, -2)
