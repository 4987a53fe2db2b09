"""The target's next-token distribution as a training row sees it: from the target's stored last layer
(its full logits), or from its stored top-k log-probabilities with the tail's mass as one bucket.

Contract (:mod:`dflash_staged.train.objective.terms` and the families' objectives take ``p`` from here):

* **Full.** ``p = softmax(t / T)`` of the target's logits ``t`` (recomputed from its last layer, its
  final norm and head; :mod:`dflash_staged.model.target.logits`).
* **Top-k** (``[target] store_topk``). The store holds, for each position, the ``k`` most likely ids,
  their log-probabilities at the store's temperature ``Ts`` (fp16) and the log of the tail's mass
  ``log r = logsumexp(z outside the ids) - logsumexp(z)``, ``z`` the logits over ``Ts``, computed by
  extract from the logits in log space (float32, exact to rounding however small ``r`` is). A row's
  target is then ``p~``: on the ``k`` ids the stored probabilities scaled to sum to ``1 - r`` (fp16's
  rounding removed), and ``r`` spread over every other token in proportion to the drafter's own ``q``
  (at the same temperature, detached): ``log p~_i = log q_i + log r - log q_rest`` with
  ``log q_rest = logsumexp(log q outside the ids)``. Everything is formed in log space: no sum of
  probabilities is ever subtracted from 1, so a drafter that puts less than float32's resolution
  outside the ids (a confident drafter on an easy token) still gets finite values and gradients.
* Every term of ``p~`` and ``q`` equals that term of the two distributions *bucketed* as (the ``k``
  ids one by one, the tail as one outcome): ``KL = sum_top p log(p / q) + r log(r / q_rest)``,
  ``TV = (sum_top |p - q| + |r - q_rest|) / 2``, reverse KL, JSD and ``sum min(p, q)`` likewise; and,
  ``p~`` held constant, its gradient in the drafter's logits is the bucketed term's gradient (the
  tail's tokens all move in proportion to ``q``). With ``k = V``, or a tail of one token, ``p~`` is the
  target's distribution and every term exact; otherwise the bucketed divergences are lower bounds of
  the full ones (data processing) and the overlap an upper bound.
* **Fewer than stored** (``train.target_topk``): :meth:`TopK.first` keeps the first ``k'`` entries
  and adds the others' mass to the tail, in log space.
* **Older stores** (written before the tail was stored): ``r = 1 - sum exp(logp)`` in float64, clamped
  at 0 (:func:`legacy_logtail`). fp16 entries are off by up to 2.4e-4 of their probability, so such a
  tail is unreliable below ~1e-4; the trainer says so in one line at start (re-extract to fix it).
* **Draft vocabulary** (:meth:`TopK.restrict`): the entries outside it are dropped (log-probability
  ``-inf``) and the rest renormalised with the tail; a dropped entry's id repeats the first kept one's,
  so every consumer ignores entries at ``-inf`` (:func:`topk_logp` scatters with ``amax``).
* No ``[rows, V]`` tensor of the target is read or kept beyond the chunk that forms ``p~``, and the
  trainer needs no target head. The target's argmax is the first stored id (most likely first).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dflash_staged.model.target.logits import log_probs


class TopK(NamedTuple):
    """The target's stored top-k over some rows: ids ``[c, k]``, log-probabilities ``[c, k]``, and the
    log of the tail's mass ``[c]`` (None: a store written before it was kept; see the contract)."""

    ids: torch.Tensor
    logp: torch.Tensor
    logtail: torch.Tensor | None = None

    def rows(self, idx: torch.Tensor) -> TopK:
        """The same for the rows ``idx``."""
        tail = None if self.logtail is None else self.logtail[idx]
        return TopK(self.ids[idx], self.logp[idx], tail)

    def first(self, k: int | None) -> TopK:
        """The first ``k`` entries (None or 0: all), the dropped ones' mass added to the tail."""
        if not k or k >= self.ids.shape[-1]:
            return self
        tail = self.tail()
        dropped = torch.logsumexp(self.logp[:, k:].to(tail.dtype), -1)
        return TopK(self.ids[:, :k], self.logp[:, :k], torch.logaddexp(tail, dropped).clamp_max(0.0))

    def restrict(self, t2d: torch.Tensor) -> TopK:
        """The same over a draft vocabulary (``t2d [V]``: each target id's draft id, -1 outside): ids
        become draft ids, entries outside are dropped (log-probability ``-inf``, moved after the kept
        ones, their id a copy of the first kept one's), and the distribution is renormalised over the
        kept entries and the tail, the tail's mass taken as all inside the vocabulary (so the tail's
        share is an upper bound). A row with no entry inside keeps only its tail."""
        tail = self.tail().float()
        d = t2d.to(self.ids.device)[self.ids.long()]
        logp = torch.where(d >= 0, self.logp.float(), float("-inf"))
        logp, order = logp.sort(dim=-1, descending=True, stable=True)
        d = d.gather(1, order)
        d = torch.where(torch.isfinite(logp), d, d[:, :1].clamp_min(0))
        z = torch.logaddexp(torch.logsumexp(logp, -1), tail)
        return TopK(d, logp - z[:, None], (tail - z).clamp_max(0.0))

    def tail(self) -> torch.Tensor:
        """``log r [c]``: stored (float32), else :func:`legacy_logtail` (float32, float64 for a float64
        top-k)."""
        if self.logtail is not None:
            return self.logtail
        return legacy_logtail(self.logp).to(torch.promote_types(self.logp.dtype, torch.float32))


def legacy_logtail(logp: torch.Tensor) -> torch.Tensor:
    """``log(1 - sum exp(logp))`` in float64, clamped at 0 (``-inf``): the tail of a store without one."""
    return (1.0 - logp.double().exp().sum(-1)).clamp_min(0.0).log()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate at both ends (``-inf`` -> 0)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def topk_logp(logq: torch.Tensor, top: TopK) -> torch.Tensor:
    """``log p~`` of each row (see the module contract) from ``logq [c, V]``, the drafter's
    log-probabilities at the store's temperature (used detached) -> ``[c, V]`` in ``logq``'s dtype
    (at least float32); entries are floored at the dtype's smallest normal (``log p~ > -inf``)."""
    dt = torch.promote_types(logq.dtype, torch.float32)
    ids = top.ids.long()
    out = logq.detach().to(dt, copy=True).scatter_(1, ids, float("-inf"))
    logq_rest = torch.logsumexp(out, -1).clamp_min(torch.finfo(dt).min)  # (-inf only if q has no tail)
    logtail = top.tail().to(dt).clamp_max(0.0)  # (fp16 rounding must not put the tail above 1)
    shift = torch.where(torch.isneginf(logtail), logtail, logtail - logq_rest)  # no tail: -inf (not nan)
    out.add_(shift[:, None])
    lp = top.logp.to(dt)
    vals = log_probs(lp).add_(log1mexp(logtail)[:, None])  # (log_probs: its digits near 0)
    out.scatter_reduce_(1, ids, vals.nan_to_num_(nan=float("-inf")), "amax")  # (dropped entries: -inf)
    return out.clamp_min_(math.log(torch.finfo(dt).tiny))
