"""Sampling for ``dflash eval --temperature T`` (T > 0): the target's distribution and lossless
rejection sampling of a drafter's proposals.

Contract (the tests check it exactly on a toy vocabulary):

* **Target distribution** ``p`` (:func:`target_probs`) at a position = the target's logits divided by
  the temperature, then top-k (keep the ``k`` largest, ties at the k-th value kept; 0 = off), then
  top-p (keep the smallest set of most likely tokens whose mass reaches ``top_p``, always at least
  one), then softmax: the order and the tie rules of Hugging Face's ``TemperatureLogitsWarper``,
  ``TopKLogitsWarper`` and ``TopPLogitsWarper``, which vLLM's sampler also follows.
* **Proposal** ``q`` of the ``n`` drafts of a block, one row per draft: dense ``[n, V]``, or sparse
  (:class:`SparseQ`: candidate ids ``[n, K]`` and their probabilities ``[n, K]``, zero elsewhere). A
  draft must have been drawn from its row (row ``k`` may depend on drafts ``1..k-1``). A DFlash v1
  drafter's ``q`` (:meth:`Sampler.propose`) is, by default (``draft_sampling="filtered"``), the same
  transform as the target's (temperature, top-k, top-p) applied to the drafter's logits, as the
  reference ``dflash_generate`` draws its drafts; ``"temperature"`` keeps the temperature alone,
  ``softmax(logits / T)``. Both are lossless; the acceptance length differs.
* **Verification** (:meth:`Sampler.verify`): draft ``k`` is accepted with probability
  ``min(1, p_k(d_k) / q_k(d_k))`` (:func:`acceptance_probs`), in order; at the first rejection the
  step's last token is drawn from ``normalize(max(0, p_k - q_k))`` (:func:`residual_probs`; from
  ``p_k`` when that is all zero, which only rounding can cause); if all ``n`` are accepted it is the
  bonus, drawn from ``p_{n+1}``. The verify draws ``n`` uniforms at once (draft ``k`` accepted while
  ``u_k`` is below its acceptance probability) and then that token, as z-lab's and DeepSpec's harnesses
  draw it, so the two can be fed the same draws and compared step by step; :func:`verify_law` writes
  the law out. The committed tokens are then distributed exactly as sampling the target token by
  token from ``p`` (Leviathan et al. 2023; Chen et al. 2023), whatever ``q`` is.
* **Randomness** comes only from the sampler's ``torch.Generator`` per device, seeded by ``seed``
  (:meth:`Sampler.reseed`), so a run is reproducible on the same device, software and settings.
* ``temperature == 0`` is greedy (argmax); ``top_p`` and ``top_k`` are then unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from dflash_staged.errors import DflashError


class SparseQ(NamedTuple):
    """A sparse proposal: row ``k`` puts ``probs[k, j]`` on token ``ids[k, j]`` and zero elsewhere."""

    ids: torch.Tensor  # [n, K] long
    probs: torch.Tensor  # [n, K]


@dataclass(frozen=True)
class SamplingSettings:
    """What ``dflash eval`` samples with; ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    draft_sampling: str = "filtered"  # a v1 drafter's proposal: "filtered" (the reference) or "temperature"

    def __post_init__(self):
        if self.draft_sampling not in ("filtered", "temperature"):
            raise DflashError(f"--draft-sampling {self.draft_sampling!r}: use filtered or temperature")
        if not self.temperature >= 0:
            raise DflashError(f"--temperature {self.temperature}: expected a number >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise DflashError(f"--top-p {self.top_p}: expected a number in (0, 1] (1 = off)")
        if self.top_k < 0:
            raise DflashError(f"--top-k {self.top_k}: expected an integer >= 0 (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> dict:
        """The settings as a report states them: ``mode`` is ``greedy`` or ``sampled``."""
        if self.greedy:
            return {"mode": "greedy", "temperature": 0.0, "top_p": None, "top_k": None, "seed": None}
        return {
            "mode": "sampled",
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "seed": int(self.seed),
            "draft_sampling": self.draft_sampling,
        }

    def label(self) -> str:
        """One short phrase, e.g. ``greedy`` or ``T=1, top-p 0.95, top-k 20, seed 0``."""
        if self.greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        return ", ".join(parts + [f"seed {self.seed}"])


def label_of(described: dict | None) -> str:
    """:meth:`SamplingSettings.label` of a report's ``sampling`` (greedy when absent)."""
    if not described or described.get("mode") == "greedy":
        return "greedy"
    d = described
    return SamplingSettings(d["temperature"], d["top_p"], d["top_k"], d["seed"]).label()


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def target_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """``p`` of the module docstring for each row of ``logits [..., V]`` (float32 at least)."""
    x = _wide(logits) / temperature
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1:
        srt, idx = torch.sort(x, dim=-1, descending=False)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False  # the most likely token always stays
        x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return x.softmax(-1)


def dense_q(q, vocab: int) -> torch.Tensor:
    """A proposal (dense ``[n, V]`` or :class:`SparseQ`) as a dense ``[n, V]`` tensor."""
    if isinstance(q, torch.Tensor):
        return _wide(q)
    ids, probs = q
    out = torch.zeros(ids.shape[0], vocab, dtype=_wide(probs).dtype, device=probs.device)
    return out.scatter_add_(1, ids.long(), _wide(probs))


def proposal_rows(q, n: int):
    """The first ``n`` rows of a proposal."""
    return q[:n] if isinstance(q, torch.Tensor) else SparseQ(q[0][:n], q[1][:n])


def proposal_of(q, drafts: torch.Tensor) -> torch.Tensor:
    """``q_k(d_k)`` for each row ``k``: ``[n]``."""
    d = drafts.long().reshape(-1, 1)
    if isinstance(q, torch.Tensor):
        return _wide(q).gather(1, d)[:, 0]
    ids, probs = q
    return (_wide(probs) * (ids.long() == d)).sum(1)


def acceptance_probs(p: torch.Tensor, q, drafts: torch.Tensor) -> torch.Tensor:
    """``min(1, p_k(d_k) / q_k(d_k))`` for the ``n`` drafts (``p``: at least ``n`` rows): ``[n]``."""
    n = drafts.numel()
    pd = p[:n].gather(1, drafts.long().reshape(-1, 1).to(p.device))[:, 0]
    qd = proposal_of(q, drafts.to(p.device)).to(pd)
    return torch.where(qd > 0, (pd / qd.clamp_min(torch.finfo(qd.dtype).tiny)).clamp(max=1), (pd > 0).to(pd))


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalize(max(0, p - q))`` of each row (dense ``q``); a row of ``p`` where that is all zero."""
    r = (p - q.to(p)).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def verify_law(p: torch.Tensor, q, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact law of one verify of ``n`` drafts, ``p`` the target's ``n + 1`` rows: ``(stop [n+1],
    last [n+1, V])``, ``stop[a]`` the probability that exactly the first ``a`` drafts are accepted
    and ``last[a]`` the distribution of the step's last token then (the residual of row ``a``, or
    the bonus row ``p[n]`` when ``a == n``). :meth:`Sampler.verify` draws from it."""
    n = drafts.numel()
    if n == 0:
        return p.new_ones(1), p[:1]
    acc = acceptance_probs(p, q, drafts)
    one = p.new_ones(1)
    stop = torch.cat([one, acc.cumprod(0)]) * torch.cat([1 - acc, one])
    return stop, torch.cat([residual_probs(p[:n], dense_q(q, p.shape[-1])[:n]), p[n : n + 1]])


class Sampler:
    """Target distributions, proposals and verification at the given :class:`SamplingSettings`."""

    def __init__(self, settings: SamplingSettings):
        self.settings = settings
        self._gens: dict[str, torch.Generator] = {}
        self._seed = settings.seed

    @property
    def temperature(self) -> float:
        return self.settings.temperature

    @property
    def greedy(self) -> bool:
        return self.settings.greedy

    def reseed(self, seed: int) -> None:
        """Start every device's stream afresh from ``seed``."""
        self._seed, self._gens = int(seed), {}

    def generator(self, device) -> torch.Generator:
        """This sampler's generator on ``device`` (created, seeded, on first use)."""
        device = torch.device(device)
        key = str(device)
        if key not in self._gens:
            self._gens[key] = torch.Generator(device=device).manual_seed(self._seed)
        return self._gens[key]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The target distribution ``p`` of each row of ``logits``."""
        s = self.settings
        return target_probs(logits, s.temperature, s.top_k, s.top_p)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of ``probs [n, V]``: ``[n]``."""
        return torch.multinomial(probs, 1, generator=self.generator(probs.device))[:, 0]

    def next_token(self, logits: torch.Tensor) -> int:
        """A token from one position's logits ``[V]``: argmax when greedy, else drawn from ``p``."""
        if self.greedy:
            return int(logits.argmax())
        return int(self.sample(self.probs(logits[None]))[0])

    def propose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A DFlash v1 proposal from drafter logits ``[n, V]``: drafts ``[n]`` drawn from ``q`` (the
        module docstring: the target's transform, or the temperature alone), and ``q`` (dense)."""
        if self.settings.draft_sampling == "filtered":
            q = self.probs(logits)
        else:
            q = (_wide(logits) / self.temperature).softmax(-1)
        return self.sample(q), q

    def verify(self, drafts: torch.Tensor, q, logits: torch.Tensor) -> tuple[int, int]:
        """Rejection sampling of ``n`` drafts against the target's ``logits [n+1, V]`` of the verified
        block ``[anchor, d_1 .. d_n]`` (row 0 predicts ``d_1``, row ``n`` the bonus): ``(a, token)``,
        the number of drafts accepted and the step's last token (resampled or bonus). As the
        references draw it (z-lab's ``_rejection_sample``, DeepSpec's ``verify_draft_tokens``): ``n``
        uniforms at once, draft ``k`` accepted while ``u_k < min(1, p_k(d_k) / q_k(d_k))``, then one
        draw of the last token from the residual of the first rejected row or from ``p_n``; its law is
        :func:`verify_law`'s."""
        n = drafts.numel()
        p = self.probs(logits[: n + 1])
        if n == 0:
            return 0, int(self.sample(p[:1])[0])
        acc = acceptance_probs(p, q, drafts)
        u = torch.rand(n, generator=self.generator(p.device), device=p.device)
        a = int((u.to(acc) < acc).long().cumprod(0).sum())
        last = (
            p[n : n + 1]
            if a == n
            else residual_probs(p[a : a + 1], dense_q(proposal_rows(q, a + 1), p.shape[-1])[a:])
        )
        return a, int(self.sample(last)[0])
