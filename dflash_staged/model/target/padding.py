"""Batches of token sequences for the target: right padding in, the real tokens back out.

Right padding keeps a sample's real rows independent of what it is batched with (causal layers);
the contract is in :mod:`dflash_staged.model.target`.
"""

from __future__ import annotations

import torch


def pad_batch(seqs, pad_id: int = 0, device=None):
    """Right-pad token sequences: ``(input_ids [B, L], attention_mask [B, L], lengths [B])``, all int64."""
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs]
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("pad_batch needs at least one sequence and no empty ones")
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    L = int(lengths.max())
    input_ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = s
    attention_mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
    if device is not None:
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    return input_ids, attention_mask, lengths


def pack_unpadded(captured: torch.Tensor, lengths) -> torch.Tensor:
    """Keep the real tokens of a right-padded ``[B, L, ...]`` tensor: ``[sum(lengths), ...]``, batch order."""
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=captured.device)
    keep = torch.arange(captured.shape[1], device=captured.device)[None, :] < lengths[:, None]
    return captured[keep]
