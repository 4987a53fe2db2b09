"""Terms on the acceptance rate itself. Under speculative sampling a drafted token is accepted with
probability ``alpha = sum min(p, q)`` (the overlap of the target's ``p`` and the drafter's ``q``), so
total variation ``TV = 1 - alpha`` is the rejection rate.

* ``tv``: ``1 - sum min(p, q)``, formed as ``sum |p - q| / 2`` (exact near 0, where a difference
  from 1 would be float32's rounding). With ``z = u / T`` and ``S`` the tokens where ``q <= p``,
  d/dz_i = ``-q_i (1[i in S] - sum_{j in S} q_j)`` (the sign convention of Liger's and vLLM
  speculators' TV kernels); its gradient vanishes where the two barely overlap, hence:
* ``lk``: the hybrid LK loss of Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for
  Speculative Decoding" (arXiv 2602.23881): ``lambda KL(p || q) + (1 - lambda) TV`` with
  ``lambda = exp(-eta sg[alpha])``: KL's strong gradient while the overlap is low, the acceptance
  rate itself as it grows. The blend is per row, as vLLM speculators ships it
  (``lk_hybrid_loss``, ``models/metrics.py`` and its fused twin; eta 3.0 by default,
  ``train.lk_eta``); the paper's variant takes the mean alpha of a draft depth.
* ``lk_alpha``: the paper's ``L_alpha = -log alpha`` (speculators' "nla"): gradient ``grad TV /
  alpha``, TV's direction with a magnitude that grows as the overlap shrinks; alpha is clamped at
  1e-5 as speculators does.
"""

from __future__ import annotations

import torch

from dflash_staged.train.objective.terms import Chunk, term
from dflash_staged.train.objective.terms.divergence import kl_value_grad

ALPHA_MIN = 1e-5


def tv_value_grad(c: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    below = c.below
    s = (c.q * below).sum(-1, keepdim=True)
    return c.tv, below.to(c.q.dtype).sub_(s).mul_(c.q).mul_(-1.0 / c.T)


@term("tv", needs_target=True)
def tv(c: Chunk):
    return tv_value_grad(c)


def lk_weight(alpha: torch.Tensor, eta: float) -> torch.Tensor:
    """``lambda = exp(-eta alpha)``, alpha detached: the share of KL in the hybrid."""
    return torch.exp(-eta * alpha.detach())


@term("lk", needs_target=True)
def lk(c: Chunk):
    lam = lk_weight(c.overlap, c.lk_eta)
    kl_v, kl_g = kl_value_grad(c)
    tv_v, tv_g = tv_value_grad(c)
    return lam * kl_v + (1 - lam) * tv_v, kl_g.mul_(lam[:, None]).add_(tv_g.mul_((1 - lam)[:, None]))


@term("lk_alpha", needs_target=True)
def lk_alpha(c: Chunk):
    raw = c.overlap
    alpha = raw.clamp_min(ALPHA_MIN)
    tv, tv_g = tv_value_grad(c)
    clamped = raw < ALPHA_MIN
    scale = torch.where(clamped, torch.zeros_like(alpha), 1.0 / alpha)  # clamped: no gradient
    # -log alpha from whichever of alpha (small) and TV (alpha near 1) float32 holds to more digits
    value = torch.where(alpha < 0.5, -alpha.log(), -torch.log1p(-tv.clamp(max=0.5)))
    return value, tv_g.mul_(scale[:, None])
