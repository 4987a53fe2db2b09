"""Matched draws for sampled decoding: while active, every ``torch.rand``, ``torch.rand_like`` and
``torch.multinomial`` call, ours or a reference's, takes its uniforms from one seeded stream in call
order (``multinomial`` by the inverse of each row's CDF). Two decoders that draw the same kinds of
things in the same order from equal distributions then make the same choices, so a sampled decode can
be compared step by step rather than in distribution."""

from __future__ import annotations

import contextlib
import math

import torch


class SharedUniforms:
    def __init__(self, seed: int):
        self._rand = torch.rand
        self.g = torch.Generator().manual_seed(seed)
        self.used = 0

    def take(self, n: int) -> torch.Tensor:
        self.used += n
        return self._rand(n, generator=self.g, dtype=torch.float64)

    def rand(self, *size, generator=None, dtype=None, device=None, **_):
        size = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        return self.take(math.prod(size)).reshape(size).to(dtype or torch.float32)

    def rand_like(self, t, **_):
        return self.take(t.numel()).reshape(t.shape).to(t.dtype)

    def multinomial(self, probs, num_samples, replacement=False, *, generator=None, out=None):
        assert num_samples == 1, "matched draws: one sample a row"
        rows = probs.double().reshape(-1, probs.shape[-1])
        cdf = rows.cumsum(-1)
        u = self.take(rows.shape[0]) * cdf[:, -1]
        idx = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=rows.shape[-1] - 1)
        return idx.reshape(*probs.shape[:-1], 1).to(probs.device)


@contextlib.contextmanager
def matched_draws(seed: int, monkeypatch):
    """Route torch's draws through one :class:`SharedUniforms` (restored on exit)."""
    s = SharedUniforms(seed)
    with monkeypatch.context() as m:
        m.setattr(torch, "rand", s.rand)
        m.setattr(torch, "rand_like", s.rand_like)
        m.setattr(torch, "multinomial", s.multinomial)
        yield s
