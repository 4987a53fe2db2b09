"""The target's next-token distribution as a training row sees it: from the target's stored last layer
(its full logits), or from its stored top-k log-probabilities with the tail's mass as one bucket.

Contract (:mod:`dflash_staged.train.objective.terms` and the families' objectives take ``p`` from here):

* **Full.** ``p = softmax(t / T)`` of the target's logits ``t`` (recomputed from its last layer, its
  final norm and head).
* **Top-k** (``[target] store_topk``). The store holds, for each position, the ``k`` most likely
  ids and their log-probabilities at the store's temperature ``Ts`` (a log-softmax over the whole
  vocabulary, so ``p_top`` are the target's true probabilities and ``r = 1 - sum p_top`` the tail's
  mass). A row's target is then ``p~``: ``p_top`` on the ``k`` ids, and ``r`` spread over every other
  token in proportion to the drafter's own ``q`` (at the same temperature, detached). Every term of
  ``p~`` and ``q`` equals that term of the two distributions *bucketed* as (the ``k`` ids one by one,
  the tail as one outcome): ``KL = sum_top p log(p / q) + r log(r / q_rest)``,
  ``TV = (sum_top |p - q| + |r - q_rest|) / 2``, reverse KL, JSD and ``sum min(p, q)`` likewise; and,
  ``p~`` held constant, its gradient in the drafter's logits is the bucketed term's gradient (the
  tail's tokens all move in proportion to ``q``). With ``k = V``, or a tail of one token, ``p~`` is the
  target's distribution and every term exact; otherwise the bucketed divergences are lower bounds of
  the full ones (data processing) and the overlap an upper bound. No ``[rows, V]`` tensor of the
  target is read or kept beyond the chunk that forms ``p~``, and the trainer needs no target head.
* The target's argmax is the first stored id (the top-k are stored most likely first).
"""

from __future__ import annotations

import torch

TINY = torch.finfo(torch.float32).tiny


def topk_logp(q: torch.Tensor, ids: torch.Tensor, logp_top: torch.Tensor) -> torch.Tensor:
    """``log p~`` of each row (see the module contract): ``q [c, V]`` the drafter's probabilities at the
    store's temperature (used detached), ``ids [c, k]``, ``logp_top [c, k]`` -> ``[c, V]`` (float32, or
    ``q``'s dtype when wider)."""
    dt = torch.promote_types(q.dtype, torch.float32)
    q = q.detach().to(dt)
    p_top = logp_top.double().exp()  # the masses 1 - sum in float64: a small tail is a difference of ~1s
    r = (1.0 - p_top.sum(-1)).clamp_min(0.0)
    q_rest = (1.0 - q.gather(1, ids.long()).double().sum(-1)).clamp_min(TINY)
    p = q * (r / q_rest).to(dt)[:, None]
    p.scatter_(1, ids.long(), p_top.to(dt))
    return p.clamp_min(TINY).log()
