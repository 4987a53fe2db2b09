"""Position weights over a block's offsets: DFlash's decay, or D-PACE's acceptance-shaped weights."""

from __future__ import annotations

import torch


def decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """``exp(-(k-1)/gamma)`` for k = 1..B-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def dpace_weights(p_label: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE position weights ``[A, B-1]`` from the drafter's probability of each label (detached):
    ``w_j = sum_{m >= j} prod_{i <= m} q_i`` with ``q = (1 - alpha) p + alpha``, over valid offsets
    (an invalid one neither breaks the product nor adds a term), 0 at invalid offsets."""
    q = torch.where(valid, (1 - alpha) * p_label.detach().float() + alpha, torch.ones_like(p_label).float())
    terms = torch.cumprod(q, dim=1) * valid
    return terms.flip(1).cumsum(1).flip(1) * valid
