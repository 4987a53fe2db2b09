"""Divergences from the target's distribution ``p`` to the drafter's ``q``, both at
``train.distill_temperature`` T (logits divided by T): forward KL, reverse KL and Jensen-Shannon.

With ``z = u / T`` the gradients are, per row (the closed forms vLLM speculators' fused loss kernels
use, ``models/fused_losses.py``, derived there from SpecForge's ``specforge/core/loss.py``):

* ``kl``  = ``sum p (log p - log q)``;  d/dz = ``q - p``
* ``rkl`` = ``sum q (log q - log p)``;  d/dz = ``q (log q - log p - rkl)``
* ``jsd`` = ``(KL(p || m) + KL(q || m)) / 2``, ``m = (p + q) / 2``;
  d/dz = ``q (log q - log m - KL(q || m)) / 2``

and d/du = d/dz / T.
"""

from __future__ import annotations

import torch

from dflash_staged.train.objective.terms import LN2, Chunk, term


def kl_value_grad(c: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward KL(p || q) and its gradient in ``u`` (shared with the LK hybrid)."""
    value = (c.p * (c.logp - c.logq)).sum(-1)
    return value, (c.q - c.p).div_(c.T)


@term("kl", needs_target=True)
def kl(c: Chunk):
    return kl_value_grad(c)


@term("rkl", needs_target=True)
def rkl(c: Chunk):
    diff = c.logq - c.logp
    value = (c.q * diff).sum(-1)
    return value, diff.sub_(value[:, None]).mul_(c.q).div_(c.T)


@term("jsd", needs_target=True)
def jsd(c: Chunk):
    logm = torch.logaddexp(c.logp, c.logq) - LN2
    kl_pm = (c.p * (c.logp - logm)).sum(-1)
    d = c.logq - logm
    kl_qm = (c.q * d).sum(-1)
    return 0.5 * (kl_pm + kl_qm), d.sub_(kl_qm[:, None]).mul_(c.q).mul_(0.5 / c.T)
