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
  detached, each row's CE, L1, acceptance ``clamp(1 - L1 / 2, 0, 1)``, whether its argmax is the label
  and whether it is the target's argmax; with ``cand_k > 0`` also the top ``cand_k`` of each row's
  ``u`` and the target's probabilities on them (DSpine's refinement candidates).
* The gradients are formed in the forward, per chunk (``d CE / du = q - onehot``,
  ``d L1 / du = q (s - <s, q>)`` with ``s = sign(q - p)``, ``p`` held constant), and kept: the backward
  only scales them. No ``[rows, V]`` tensor outlives its chunk and nothing is recomputed, so a row
  costs two vocabulary-sized products for the drafter (its logits, their gradient) and one for the
  target (none with the top-k).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dflash_staged.model.drafters.layers import transform_logits
from dflash_staged.model.drafters.target_dist import topk_logp


class HeadInputs(NamedTuple):
    W: torch.Tensor  # [V, H] the frozen head
    labels: torch.Tensor  # [R]
    weights: torch.Tensor  # [R] position weights (0: the row does not count)
    tpos: torch.Tensor  # [R] the position whose target distribution each row learns
    last: torch.Tensor | None  # [T, H] the target's last layer (with norm), or None
    norm: torch.nn.Module | None
    top: tuple[torch.Tensor, torch.Tensor] | None  # the target's top-k [T, k] (ids, log-probs), or None
    multiplier: float
    softcap: float | None
    ce_weight: float
    l1_weight: float
    chunk: int
    cand_k: int = 0  # also return each row's top cand_k candidates and the target's mass on them


def _slope(raw: torch.Tensor, multiplier: float, softcap: float | None):
    if softcap:
        return multiplier * (1 - torch.tanh(raw * (multiplier / softcap)).pow(2))
    return multiplier


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
                logq = torch.log_softmax(u, -1)
                q = logq.exp()
                pos, y = x.tpos[s:e], x.labels[s:e]
                if x.top is None:
                    xt = x.norm(x.last[pos]).to(W.dtype)
                    t = transform_logits((xt @ W.t()).float(), x.multiplier, x.softcap)
                    p, argmax = torch.softmax(t, -1), t.argmax(-1)
                    del t, xt
                else:
                    ids = x.top[0][pos]
                    p, argmax = topk_logp(q, ids, x.top[1][pos]).exp(), ids[:, 0].long()
                ce[s:e] = -logq.gather(1, y[:, None])[:, 0]
                sign = torch.sign(q - p)
                l1[s:e] = (q - p).abs().sum(-1)
                accept[s:e] = (1.0 - 0.5 * l1[s:e]).clamp(0.0, 1.0)
                top = u.argmax(-1)
                hits[s:e], t_hits[s:e] = top == y, top == argmax
                if x.cand_k:
                    cand[s:e] = u.topk(min(x.cand_k, u.shape[-1]), dim=-1).indices
                    p_cand[s:e] = p.gather(1, cand[s:e])
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
                            g.mul_(_slope(raw, x.multiplier, x.softcap))
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
