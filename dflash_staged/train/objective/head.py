"""The frozen LM head over drafter states, in chunks: each row's loss (the weighted terms of
``train.loss``), its metrics, and the top-k for DFlash2.

Contract (:mod:`dflash_staged.train.objective.loss` weighs the rows; nothing else forms logits in
training):

* :func:`head_rows` takes final-normed states ``h [P, H]``, the frozen head ``W [V, H]``, the data's
  labels ``[P]`` and optionally the target's rows (:class:`TargetRows`: its stored last layer, the
  position each row reads and the target's final norm; or :class:`TopkRows`: its stored top-k, whose
  tail :mod:`dflash_staged.model.drafters.target_dist` treats). It forms ``chunk`` rows at a time the
  drafter's logits and, with the target's rows, the target's logits from ``norm(last) @ W^T``, both
  through the target's logit transform (``output_multiplier``, ``final_logit_softcapping``; see
  :mod:`dflash_staged.model.drafters.dflash2.modules`). No ``[rows, V]`` tensor outlives its chunk, for the
  drafter or the target, in the forward or the backward.
* It returns :class:`HeadRows`: ``loss``, each row's value of the weighted terms
  (:func:`~dflash_staged.train.objective.terms.combine`, differentiable in ``h``); top-1 ``hits``
  against the data label; ``p_label``, the drafter's probability of the row's label (the target's
  argmax with ``target_label``, else the data's; detached: D-PACE weighs with it); with the target's
  rows, ``target_ids`` (its argmax), ``target_hits`` (the drafter's argmax is the target's) and
  ``overlap`` (``sum min(p, q)`` at temperature 1: the row's acceptance rate under sampling; from a
  top-k, the estimate :func:`~dflash_staged.model.drafters.distill_head.acceptance` gives); and, when
  ``top_k > 0``, the top-k transformed logits, their ids and slopes (the DFlash2 selector's candidates;
  :func:`top_values` makes the values differentiable in ``h`` again) and, with the target,
  ``top_mass``: the target's probability on those candidates (from a top-k, on those among its ids).
* **Memory.** Each chunk's gradient of the loss to ``h`` is formed during the forward and kept
  (``[P, H]``); the backward scales those rows by the incoming per-row gradient, so any per-row
  weights (decay, D-PACE) may be chosen after the forward. A chunk holds about 3 fp32 ``[chunk, V]``
  tensors for ``ce`` alone and 8 to 10 with the target's logits (peak RSS on CPU over one tensor's
  size, the process's own included: ce 3.9, kl 9.0, ce + tv 9.2, jsd 10.0, lk 10.2;
  ``train.memory`` counts 3 and 10).
* Matmuls run in ``W``'s dtype with autocast off; softmax and the terms in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dflash_staged.model.drafters.distill_head import acceptance, candidate_mass
from dflash_staged.model.drafters.target_dist import TopK
from dflash_staged.model.target.logits import log_probs, target_logits, transform_logits, transform_slope
from dflash_staged.train.objective.terms import Chunk, combine


class TargetRows(NamedTuple):
    """The target's side of the head: its last layer's outputs ``states [T, H]`` (before its final
    norm), the position each head row reads (``pos [P]``: the token before the row's label) and the
    target's final norm (:class:`~dflash_staged.model.target.weights.FinalNorm`)."""

    states: torch.Tensor
    pos: torch.Tensor
    norm: torch.nn.Module


class TopkRows(NamedTuple):
    """The target's side of the head from its stored top-k (:class:`TopK` over ``T`` positions, at the
    distillation temperature) and the position each head row reads (``pos [P]``).
    :mod:`dflash_staged.model.drafters.target_dist` says how the tail is treated."""

    top: TopK
    pos: torch.Tensor


class HeadRows(NamedTuple):
    loss: torch.Tensor  # [P] the weighted terms' value (differentiable in h)
    hits: torch.Tensor  # [P] bool: the data label is the top-1
    p_label: torch.Tensor  # [P] probability of the row's label (detached)
    top_vals: torch.Tensor  # [P, k] top-k transformed logits (detached; k = 0 unless asked)
    top_ids: torch.Tensor  # [P, k] their token ids
    top_slope: torch.Tensor  # [P, k] d(transformed logit)/d(raw logit) there
    target_ids: torch.Tensor  # [P] the target's argmax (empty without the target's rows)
    target_hits: torch.Tensor  # [P] bool: the drafter's argmax is the target's
    overlap: torch.Tensor  # [P] sum min(p, q) at temperature 1
    top_mass: torch.Tensor  # [P] the target's probability on the top-k candidates (DFlash2)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk, multiplier, softcap, top_k, target, terms, opts):
        temperature, lk_eta, target_label = opts
        need_grad = ctx.needs_input_grad[0]
        P, dev = h.shape[0], h.device
        with_t = target is not None
        f32 = dict(dtype=torch.float32, device=dev)
        loss, p_label = torch.empty(P, **f32), torch.empty(P, **f32)
        hits = torch.empty(P, dtype=torch.bool, device=dev)
        vals, slope = torch.empty(P, top_k, **f32), torch.empty(P, top_k, **f32)
        ids = torch.empty(P, top_k, dtype=torch.long, device=dev)
        n_t = P if with_t else 0
        t_ids, t_hits = (
            torch.empty(n_t, dtype=torch.long, device=dev),
            torch.empty(n_t, dtype=torch.bool, device=dev),
        )
        overlap, mass = torch.empty(n_t, **f32), torch.empty(n_t if top_k else 0, **f32)
        grad_h = torch.empty_like(h) if need_grad else None
        with torch.autocast(dev.type, enabled=False):
            for s in range(0, P, chunk):
                e = min(s + chunk, P)
                hc, y = h[s:e].to(weight.dtype), labels[s:e]
                raw = (hc @ weight.t()).float()
                u = transform_logits(raw, multiplier, softcap)
                t = top = None
                if isinstance(target, TopkRows):
                    top = target.top.rows(target.pos[s:e])
                elif with_t:
                    head = lambda x: x.to(weight.dtype) @ weight.t()  # noqa: E731
                    t = target_logits(target.states[target.pos[s:e]], target.norm, head, multiplier, softcap)
                c = Chunk(u, y, t, temperature, lk_eta, top=top)
                value, g = combine(terms, c)
                loss[s:e] = value
                argmax = u.argmax(-1)
                hits[s:e] = argmax == y
                label = c.target_ids if with_t and target_label else y
                p_label[s:e] = c.logq1_at(label).exp()
                if with_t:  # (with the top-k at another temperature: the overlap at that temperature)
                    t_ids[s:e], t_hits[s:e] = c.target_ids, argmax == c.target_ids
                    at_t = temperature == 1.0 or t is None
                    p1 = c.p if at_t else log_probs(t).exp_()
                    overlap[s:e] = acceptance(p1, c.q, top) if at_t else torch.minimum(p1, c.q1).sum(-1)
                if top_k:
                    v, i = u.topk(top_k, dim=-1)
                    vals[s:e], ids[s:e] = v, i
                    slope[s:e] = transform_slope(raw.gather(1, i), multiplier, softcap)
                    if with_t:  # (from a top-k: only the stored ids' mass, as DSpine's candidates)
                        mass[s:e] = candidate_mass(p1, i, top).sum(-1)
                if need_grad:  # d loss / d u, then through the transform and the head
                    if softcap or multiplier != 1.0:
                        g.mul_(transform_slope(raw, multiplier, softcap))
                    grad_h[s:e] = (g.to(weight.dtype) @ weight).to(h.dtype)
                del c, u, t, g, raw
        ctx.save_for_backward(grad_h if need_grad else None)
        out = (loss, hits, p_label, vals, ids, slope, t_ids, t_hits, overlap, mass)
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, grad_loss, *_):
        (grad_h,) = ctx.saved_tensors
        if grad_h is None:
            return (None,) * 10
        return (grad_h.mul_(grad_loss[:, None].to(grad_h.dtype)),) + (None,) * 9


def head_rows(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int = 4096,
    multiplier: float = 1.0,
    softcap: float | None = None,
    top_k: int = 0,
    *,
    terms: dict[str, float] | None = None,
    target: TargetRows | None = None,
    temperature: float = 1.0,
    lk_eta: float = 3.0,
    target_label: bool = False,
) -> HeadRows:
    """The head over rows ``h [P, H]`` in chunks (see the module contract); ``terms`` defaults to
    ``{"ce": 1.0}``; ``target_label``: ``p_label`` is the probability of the target's argmax."""
    opts = (float(temperature), float(lk_eta), bool(target_label and target is not None))
    out = _ChunkedHead.apply(
        h,
        weight,
        labels,
        max(1, chunk),
        float(multiplier),
        softcap,
        int(top_k),
        target,
        terms or {"ce": 1.0},
        opts,
    )
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
