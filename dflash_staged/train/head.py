"""The frozen LM head over drafter states, in chunks: per-row cross-entropy, and the top-k for DFlash2.

Contract (:mod:`dflash_staged.train.objective` weighs the rows; nothing else forms logits in training):

* :func:`head_rows` takes final-normed states ``h [P, H]``, the frozen head ``W [V, H]`` and labels
  ``[P]``, and forms the logits ``chunk`` rows at a time, through the drafter's logit transform
  (``output_multiplier``, ``final_logit_softcapping``; see :mod:`dflash_staged.model.dflash2`).
  It returns :class:`HeadRows`: the per-row cross-entropy ``ce`` (differentiable in ``h``), top-1
  ``hits``, the probability of the label ``p_label`` (detached: D-PACE weighs with it) and, when
  ``top_k > 0``, the top-k transformed logits and their ids (the DFlash2 selector's candidates;
  :func:`top_values` makes the values differentiable in ``h`` again).
* **Memory.** Each chunk's gradient of ``ce`` to ``h`` is formed during the forward and kept
  (``[P, H]``), so no logits outlive a chunk, in the forward or the backward (the head is frozen:
  only the gradient to ``h`` is needed). The backward scales those rows by the incoming per-row
  gradient, so any per-row weights (decay, D-PACE) may be chosen after the forward.
* Matmuls run in ``W``'s dtype with autocast off; softmax and cross-entropy in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dflash_staged.model.dflash2 import transform_logits


class HeadRows(NamedTuple):
    ce: torch.Tensor  # [P] cross-entropy of the label (differentiable in h)
    hits: torch.Tensor  # [P] bool: the label is the top-1
    p_label: torch.Tensor  # [P] probability of the label (detached)
    top_vals: torch.Tensor  # [P, k] top-k transformed logits (detached; k = 0 unless asked)
    top_ids: torch.Tensor  # [P, k] their token ids
    top_slope: torch.Tensor  # [P, k] d(transformed logit)/d(raw logit) there


def _slope(raw: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor | float:
    """d transform / d raw logit (a float when constant)."""
    if softcap:
        return multiplier * (1 - torch.tanh(raw * (multiplier / softcap)).pow(2))
    return multiplier


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk: int, multiplier: float, softcap, top_k: int):
        need_grad = ctx.needs_input_grad[0]
        P, dev = h.shape[0], h.device
        ce = torch.empty(P, dtype=torch.float32, device=dev)
        p_label = torch.empty(P, dtype=torch.float32, device=dev)
        hits = torch.empty(P, dtype=torch.bool, device=dev)
        vals = torch.empty(P, top_k, dtype=torch.float32, device=dev)
        ids = torch.empty(P, top_k, dtype=torch.long, device=dev)
        slope = torch.empty(P, top_k, dtype=torch.float32, device=dev)
        grad_h = torch.empty_like(h) if need_grad else None
        with torch.autocast(dev.type, enabled=False):
            for s in range(0, P, chunk):
                hc, y = h[s : s + chunk].to(weight.dtype), labels[s : s + chunk]
                raw = (hc @ weight.t()).float()
                u = transform_logits(raw, multiplier, softcap)
                lse = torch.logsumexp(u, -1)
                picked = u.gather(1, y[:, None])[:, 0]
                ce[s : s + chunk] = lse - picked
                p_label[s : s + chunk] = (picked - lse).exp()
                hits[s : s + chunk] = u.argmax(-1) == y
                if top_k:
                    v, i = u.topk(top_k, dim=-1)
                    vals[s : s + chunk], ids[s : s + chunk] = v, i
                    sl = _slope(raw.gather(1, i), multiplier, softcap)
                    slope[s : s + chunk] = sl
                if need_grad:  # d ce / d u = softmax - onehot, then through the transform
                    g = u.sub_(lse[:, None]).exp_()
                    g.scatter_add_(1, y[:, None], -torch.ones_like(picked)[:, None])
                    if softcap or multiplier != 1.0:
                        g.mul_(_slope(raw, multiplier, softcap))
                    grad_h[s : s + chunk] = (g.to(weight.dtype) @ weight).to(h.dtype)
        ctx.save_for_backward(grad_h if need_grad else None)
        ctx.mark_non_differentiable(hits, p_label, vals, ids, slope)
        return ce, hits, p_label, vals, ids, slope

    @staticmethod
    def backward(ctx, grad_ce, *_):
        (grad_h,) = ctx.saved_tensors
        if grad_h is None:
            return (None,) * 7
        return grad_h.mul_(grad_ce[:, None].to(grad_h.dtype)), None, None, None, None, None, None


def head_rows(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int = 4096,
    multiplier: float = 1.0,
    softcap: float | None = None,
    top_k: int = 0,
) -> HeadRows:
    """The head over rows ``h [P, H]`` in chunks (see the module contract)."""
    out = _ChunkedHead.apply(h, weight, labels, max(1, chunk), float(multiplier), softcap, int(top_k))
    return HeadRows(*out)


class _TopValues(torch.autograd.Function):
    """The top-k values again, now with their gradient to ``h``: ``slope * W[ids]``, in chunks."""

    @staticmethod
    def forward(ctx, h, weight, vals, ids, slope, chunk: int):
        ctx.save_for_backward(weight, ids, slope)
        ctx.chunk, ctx.h_dtype = chunk, h.dtype
        return vals.clone()

    @staticmethod
    def backward(ctx, grad_vals):
        weight, ids, slope = ctx.saved_tensors
        g = (grad_vals * slope).to(weight.dtype)
        rows = max(1, ctx.chunk // max(1, ids.shape[1]))
        grad_h = torch.empty(ids.shape[0], weight.shape[1], dtype=ctx.h_dtype, device=g.device)
        for s in range(0, ids.shape[0], rows):
            w = weight[ids[s : s + rows]]  # [c, k, H]
            grad_h[s : s + rows] = (g[s : s + rows, None, :] @ w)[:, 0].to(ctx.h_dtype)
        return grad_h, None, None, None, None, None


def top_values(h: torch.Tensor, weight: torch.Tensor, rows: HeadRows, chunk: int = 4096) -> torch.Tensor:
    """``rows.top_vals`` as a function of ``h`` (for a loss on the selector's scores)."""
    return _TopValues.apply(h, weight, rows.top_vals, rows.top_ids, rows.top_slope, max(1, chunk))
