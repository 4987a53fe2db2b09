"""Small pieces every drafter family shares: Qwen3's RMSNorm and SwiGLU MLP, and RoPE's rotation (the
target's logit transform is in :mod:`dflash_staged.model.target.logits`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (half-split convention). x [..., heads, hd]; cos/sin [..., hd]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class FrozenHead(nn.Module):
    """The frozen LM head as a buffer ``weight``: saved (``lm_head.weight``) only for a draft vocabulary,
    whose rows the serving engines cannot take from the target."""

    def __init__(self, weight: torch.Tensor, persistent: bool):
        super().__init__()
        self.register_buffer("weight", weight, persistent=persistent)


class DraftCache:
    """Keys/values of the fused context, per layer, for positions ``0..length-1``: what the
    reference keeps in the draft ``DynamicCache`` once it is cropped to the committed length.
    The context's keys/values depend only on the context (it never enters the residual
    stream), so a cached position never changes; the block's are never cached."""

    def __init__(self):
        self.k: list[torch.Tensor] = []  # per layer [S, nkv, hd]
        self.v: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def crop(self, n: int) -> None:
        """Keep positions ``0..n-1``."""
        self.k = [k[:n] for k in self.k]
        self.v = [v[:n] for v in self.v]
