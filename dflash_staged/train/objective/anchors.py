"""Which blocks a microbatch trains: the anchors drawn per sequence, each block offset's label and its
validity, and the noise added to the target's features (the rules: :mod:`dflash_staged.train.objective`)."""

from __future__ import annotations

import math

import torch

from dflash_staged.errors import DflashError


def _candidates(loss_mask: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's sequence index, whether it may be an anchor) under the contract's rule."""
    dev, T = loss_mask.device, loss_mask.shape[0]
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=dev), lengths, output_size=T)
    end = cu[1:][seq]  # exclusive end of each token's sequence
    nxt = torch.cat([loss_mask[1:], loss_mask.new_zeros(1)]) > 0
    return seq, (loss_mask > 0) & nxt & (torch.arange(T, device=dev) + 1 < end)


def anchor_counts(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, num_anchors: int) -> list[int]:
    """How many anchors :func:`sample_anchors` draws from each sequence (whatever the generator):
    each anchor is one block of ``block_size`` drafter rows, so this sizes a microbatch's memory."""
    cu = cu_seqlens.to(device=loss_mask.device, dtype=torch.long)
    seq, cand = _candidates(loss_mask, cu)
    per_seq = torch.zeros(cu.numel() - 1, dtype=torch.long).index_add_(0, seq.cpu(), cand.long().cpu())
    return per_seq.clamp_max(num_anchors).tolist()


def sample_anchors(
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sorted packed indices of the anchors: up to ``num_anchors`` per sequence (see contract)."""
    dev = loss_mask.device
    T = loss_mask.shape[0]
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    seq, cand = _candidates(loss_mask, cu)
    gdev = generator.device if generator is not None else dev
    r = torch.rand(T, generator=generator, device=gdev).to(dev)
    # Sort by (sequence, candidate first, random key): the first num_anchors of each run win.
    key = seq.double() * 4 + torch.where(cand, r.double(), r.double() + 2)
    order = torch.argsort(key)
    rank = torch.arange(T, device=dev) - cu[:-1][seq]  # rank within the sequence, in `order`
    chosen = order[(rank < num_anchors) & cand[order]]
    return chosen.sort().values


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``[A, B-1]`` for offsets 1..B-1 and their validity mask (inside the sequence and
    ``loss_mask = 1``). Invalid labels are 0."""
    dev = input_ids.device
    T = input_ids.shape[0]
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    seq = torch.searchsorted(cu, anchors, right=True) - 1
    idx = anchors[:, None] + torch.arange(1, block_size, device=dev)
    valid = idx < cu[1:][seq][:, None]
    idx = idx.clamp(max=T - 1)
    valid &= loss_mask[idx] > 0
    return torch.where(valid, input_ids[idx], 0), valid


def add_noise(hidden: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Target features plus N(0, std^2) noise (drawn on the generator's device)."""
    if std <= 0:
        return hidden
    gdev = generator.device if generator is not None else hidden.device
    noise = torch.randn(hidden.shape, generator=generator, device=gdev, dtype=torch.float32)
    return (hidden.float() + std * noise.to(hidden.device)).to(hidden.dtype)


def noise_std_at(step: int, total_steps: int, noise_std: float, schedule: str = "constant") -> float:
    """Noise level at ``step``: constant, or decayed linearly / by a half cosine to 0 at ``total_steps``."""
    if noise_std <= 0:
        return 0.0
    frac = min(max(step / max(total_steps, 1), 0.0), 1.0)
    if schedule == "constant":
        return noise_std
    if schedule == "linear":
        return noise_std * (1.0 - frac)
    if schedule == "cosine":
        return noise_std * 0.5 * (1.0 + math.cos(math.pi * frac))
    raise DflashError(f"train.noise_schedule={schedule!r}: use constant, linear or cosine")
