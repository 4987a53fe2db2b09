"""The head over a family's proposal rows against the target's distribution, in chunks (DSpark's and
DSpine's backbone terms): the logits (with DSpark's Markov bias), CE on the label and L1 to the target,
each row's acceptance and hits, and their gradients formed in the same pass.

Contract (the families' objectives weigh nothing after it: the rows' weights come in):

* :func:`distill_head` takes the final-normed states ``h [R, H]``, the Markov latents ``m [R, r]`` (or
  None) and ``markov_w2 [V, r]``, and a :class:`HeadInputs` (the frozen head, labels, weights, the
  target's rows: its last layer with its final norm, or its top-k). ``loss_chunk`` rows at a time it
  forms ``u = transform(h W^T) + m w2^T`` and the target's ``p`` (full, or the top-k's ``p~`` of
  :mod:`dflash_staged.model.drafters.target_dist`), and returns the weighted sum
  ``sum_i w_i (ce_weight CE_i + l1_weight |q_i - p_i|_1)`` (differentiable in ``h``, ``m``, ``w2``) and,
  detached, each row's CE, L1, acceptance, whether its argmax is the label and whether it is the
  target's argmax; with ``cand_k > 0`` also the top ``cand_k`` of each row's ``u`` and the target's
  probabilities on them (DSpine's refinement candidates).
* **With the last layer** every value is the reference's: the acceptance is ``sum min(p, q)`` (``1 -
  TV``, formed from the minima, not as ``1 - L1 / 2``), a candidate's probability the target's own.
* **With the top-k** the L1 is the bucketed one (a lower bound of the full L1; see ``target_dist``).
  The acceptance is exact on the ids; the tail's part ``sum_tail min(p_i, q_i)`` is known only to lie
  between 0 and ``b = min(r, sum_tail min(q_i, p_k))`` (no tail token's probability exceeds the k-th
  stored one, ``p_k``, and they hold ``r`` together), and is taken as ``b / 2``: its error is at most
  ``b / 2`` whatever the drafter (0 where the drafter's tail misses the target's, ``b`` where it matches
  it). On the demo (a DSpark drafter, 1,918 rows, ``bench/topk_acceptance.py``) its mean absolute
  error is 0.0034 at k = 64 and 0.012 at k = 16, against 0.011 and 0.036 for the bound ``b`` (the
  bucketed ``min(r, q_rest)``: 0.012 and 0.037) and 0.007 and 0.014 for the ids alone. A candidate
  outside the stored ids gets probability 0 (unknown; at most ``p_k``), so DSpine's candidate mass,
  and its threshold test, count only the known mass (a lower bound), never the drafter's own belief.
* The gradients are formed in the forward, per chunk (``d CE / du = q - onehot``,
  ``d L1 / du = q (s - <s, q>)`` with ``s = sign(q - p)``, ``p`` held constant), and kept: the backward
  only scales them. No ``[rows, V]`` tensor outlives its chunk and nothing is recomputed, so a row
  costs two vocabulary-sized products for the drafter (its logits, their gradient) and one for the
  target (none with the top-k).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dflash_staged.model.drafters.target_dist import TopK, topk_logp
from dflash_staged.model.target.logits import log_probs, target_logits, transform_logits, transform_slope


class HeadInputs(NamedTuple):
    W: torch.Tensor  # [V, H] the frozen head
    labels: torch.Tensor  # [R]
    weights: torch.Tensor  # [R] position weights (0: the row does not count)
    tpos: torch.Tensor  # [R] the position whose target distribution each row learns
    last: torch.Tensor | None  # [T, H] the target's last layer (with norm), or None
    norm: torch.nn.Module | None
    top: TopK | None  # the target's top-k over the T positions, or None
    multiplier: float
    softcap: float | None
    ce_weight: float
    l1_weight: float
    chunk: int
    cand_k: int = 0  # also return each row's top cand_k candidates and the target's mass on them


def overlap_parts(p: torch.Tensor, q: torch.Tensor, top: TopK) -> tuple[torch.Tensor, torch.Tensor]:
    """From a top-k: ``sum_top min(p, q)`` (exact) and the tightest bound the store gives on the tail's
    part, ``min(r, sum_tail min(q_i, p_k))`` (no tail token is likelier than the k-th stored one)."""
    ids, kept = top.ids.long(), torch.isfinite(top.logp)  # (entries dropped by a draft vocabulary: -inf)
    on_ids = (torch.minimum(p.gather(1, ids), q.gather(1, ids)) * kept).sum(-1)
    last = (kept.sum(-1, keepdim=True) - 1).clamp_min(0)
    floor = p.gather(1, ids.gather(1, last)) * kept.any(-1, keepdim=True)
    tail = torch.minimum(q, floor).scatter_(1, ids, 0.0).sum(-1)
    return on_ids, torch.minimum(tail, top.tail().to(tail.dtype).exp())


def acceptance(p: torch.Tensor, q: torch.Tensor, top: TopK | None) -> torch.Tensor:
    """Each row's acceptance rate ``sum min(p, q)``; from a top-k, the ids' part plus half the tail's
    bound (see the module contract)."""
    if top is None:
        return torch.minimum(p, q).sum(-1).clamp_(0.0, 1.0)
    on_ids, tail = overlap_parts(p, q, top)
    return (on_ids + 0.5 * tail).clamp_(0.0, 1.0)


def candidate_mass(p: torch.Tensor, cand: torch.Tensor, top: TopK | None) -> torch.Tensor:
    """The target's probability of each candidate ``[c, n]``; from a top-k, a candidate outside the
    stored ids gets 0 (its true probability is unknown, at most the k-th stored one's)."""
    mass = p.gather(1, cand)
    if top is None:
        return mass
    known = (cand[:, :, None] == top.ids[:, None, :].long()).any(-1)
    return mass * known


class _Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, m, w2, x: HeadInputs):
        need_h, need_m, need_w2 = ctx.needs_input_grad[:3]
        R, dev, W = h.shape[0], h.device, x.W
        f32 = dict(dtype=torch.float32, device=dev)
        ce, l1, accept = torch.empty(R, **f32), torch.empty(R, **f32), torch.empty(R, **f32)
        hits, t_hits = (
            torch.empty(R, dtype=torch.bool, device=dev),
            torch.empty(R, dtype=torch.bool, device=dev),
        )
        cand = torch.zeros(R, x.cand_k, dtype=torch.long, device=dev)
        p_cand = torch.zeros(R, x.cand_k, **f32)
        grad_h = torch.empty_like(h) if need_h else None
        grad_m = torch.empty_like(m) if m is not None and need_m else None
        grad_w2 = torch.zeros(w2.shape, **f32) if w2 is not None and need_w2 else None
        with torch.autocast(dev.type, enabled=False):
            for s in range(0, R, x.chunk):
                e = min(R, s + x.chunk)
                raw = (h[s:e].to(W.dtype) @ W.t()).float()
                u = transform_logits(raw, x.multiplier, x.softcap)
                if m is not None:
                    u = u + (m[s:e].to(w2.dtype) @ w2.t()).float()
                logq = log_probs(u)
                q = logq.exp()
                pos, y = x.tpos[s:e], x.labels[s:e]
                if x.top is None:
                    head = lambda v: v.to(W.dtype) @ W.t()  # noqa: E731
                    t = target_logits(x.last[pos], x.norm, head, x.multiplier, x.softcap)
                    p, argmax, top_k = log_probs(t).exp_(), t.argmax(-1), None
                    del t
                else:
                    top_k = x.top.rows(pos)
                    p, argmax = topk_logp(logq, top_k).exp_(), top_k.ids[:, 0].long()
                ce[s:e] = -logq.gather(1, y[:, None])[:, 0]
                sign = torch.sign(q - p)
                l1[s:e] = (q - p).abs().sum(-1)
                accept[s:e] = acceptance(p, q, top_k)
                top = u.argmax(-1)
                hits[s:e], t_hits[s:e] = top == y, top == argmax
                if x.cand_k:
                    cand[s:e] = u.topk(min(x.cand_k, u.shape[-1]), dim=-1).indices
                    p_cand[s:e] = candidate_mass(p, cand[s:e], top_k)
                del logq, p
                if need_h or need_m or need_w2:
                    g = sign.sub_((sign * q).sum(-1, keepdim=True)).mul_(q).mul_(x.l1_weight)
                    g.add_(q, alpha=x.ce_weight).scatter_add_(
                        1, y[:, None], torch.full((e - s, 1), -x.ce_weight, **f32)
                    )
                    g.mul_(x.weights[s:e].float()[:, None])
                    if grad_m is not None:
                        grad_m[s:e] = (g.to(w2.dtype) @ w2).to(m.dtype)
                    if grad_w2 is not None:
                        grad_w2 += g.t() @ m[s:e].float()
                    if grad_h is not None:
                        if x.softcap or x.multiplier != 1.0:
                            g.mul_(transform_slope(raw, x.multiplier, x.softcap))
                        grad_h[s:e] = (g.to(W.dtype) @ W).to(h.dtype)
                    del g
                del q, u, raw, sign
        ctx.save_for_backward(grad_h, grad_m, grad_w2)
        loss = (x.weights.float() * (x.ce_weight * ce + x.l1_weight * l1)).sum()
        out = (loss, ce, l1, accept, hits, t_hits, cand, p_cand)
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grad_h, grad_m, grad_w2 = ctx.saved_tensors
        scale = lambda g: None if g is None else g.mul_(grad_loss.to(g.dtype))  # noqa: E731
        w2 = None if grad_w2 is None else scale(grad_w2)
        return scale(grad_h), scale(grad_m), w2, None


def distill_head(h: torch.Tensor, m: torch.Tensor | None, w2: torch.Tensor | None, x: HeadInputs):
    """(weighted loss sum, ce, l1, acceptance, hits, target hits, candidates, the target's probabilities
    on them): see the module contract."""
    return _Head.apply(h, m, w2, x)
