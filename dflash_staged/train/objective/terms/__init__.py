"""The loss terms of ``train.loss``: one module per family, each term registered by name.

Contract (:mod:`dflash_staged.train.objective.head` calls :func:`combine` once per chunk of rows):

* A term is a function of a :class:`Chunk` returning ``(value [c], grad [c, V])``: its value at each
  row and the value's gradient with respect to the drafter's (transformed) logits ``u``. The head
  chains the gradient through the logit transform and the frozen LM head, and scales each row by
  its position weight afterwards, so a term never sees weights or masks.
* A :class:`Chunk` holds the drafter's logits ``u`` and, for terms on the target's distribution,
  the target's logits ``t`` (recomputed from its stored last layer with its final norm and head, and
  the same logit transform) or its stored top-k (``top``: ids and log-probabilities at the
  distillation temperature, and the log of the tail's mass;
  :mod:`dflash_staged.model.drafters.target_dist` says how the tail is treated), and computes what the
  terms share on first use: the drafter's and the target's log-probabilities at
  ``train.distill_temperature`` (``q``, ``p``; as ``x - logsumexp(x)``,
  :func:`~dflash_staged.model.target.logits.log_probs`), the overlap ``sum min(p, q)`` and the total
  variation ``sum |p - q| / 2`` (never as ``1 - overlap``: near 1 that difference is float32's rounding).
  ``ce`` reads the data's label; every other term the target's distribution.
* :func:`combine` sums the weighted terms of ``train.loss``. Adding a term: a module here with a
  function decorated ``@term("name", needs_target=...)``, imported below, and its name in
  :data:`dflash_staged.config.train_section.LOSS_TERMS` (the config refuses other names; a test holds
  the two lists equal).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cached_property
from typing import NamedTuple

import torch

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.target_dist import TopK, topk_logp
from dflash_staged.model.target.logits import log_normaliser, log_probs


class Chunk:
    """One chunk of rows: drafter logits ``u [c, V]`` (fp32, transformed), data labels ``labels [c]``,
    target logits ``t [c, V]`` or None, the distillation temperature and the LK hybrid's eta; the
    values the terms share, computed on first use."""

    def __init__(
        self,
        u: torch.Tensor,
        labels: torch.Tensor,
        t: torch.Tensor | None = None,
        temperature: float = 1.0,
        lk_eta: float = 3.0,
        top: TopK | None = None,
    ):
        self.u, self.labels, self.t, self.T, self.lk_eta = u, labels, t, float(temperature), float(lk_eta)
        self.top = top  # the target's top-k at T (ids, log-probabilities, log tail), instead of t

    def needs_target(self, name: str) -> torch.Tensor | None:
        if self.t is None and self.top is None:
            raise DflashError(f"train.loss term {name!r} needs the target's distribution, and none was given")
        return self.t

    # -- the drafter at temperature 1 (cross-entropy) -------------------------------------------------
    @cached_property
    def norm1(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's normaliser at temperature 1 as ``(m, l)`` ``[c, 1]`` each: ``log q1 = (u - m) - l``
        (:func:`~dflash_staged.model.target.logits.log_normaliser`; nothing vocabulary-sized kept)."""
        return log_normaliser(self.u)

    def logq1_at(self, ids: torch.Tensor) -> torch.Tensor:
        """``log q1`` of token ``ids [c]`` per row (exact digits near 0: a confident row's small CE)."""
        m, lz = self.norm1
        return (self.u.gather(1, ids[:, None]) - m).sub_(lz)[:, 0]

    @cached_property
    def q1(self) -> torch.Tensor:
        m, lz = self.norm1
        return (self.u - m).sub_(lz).exp_()

    @cached_property
    def target_ids(self) -> torch.Tensor:
        t = self.needs_target("ce_target")
        return self.top.ids[:, 0].long() if t is None else t.argmax(-1)

    # -- both distributions at the distillation temperature -------------------------------------------
    @cached_property
    def logq(self) -> torch.Tensor:
        if self.T == 1.0:
            m, lz = self.norm1
            return (self.u - m).sub_(lz)
        return log_probs(self.u / self.T)

    @cached_property
    def q(self) -> torch.Tensor:
        return self.q1 if self.T == 1.0 else self.logq.exp()

    @cached_property
    def logp(self) -> torch.Tensor:
        t = self.needs_target("a distribution term")
        if t is None:
            return topk_logp(self.logq, self.top)
        return log_probs(t / self.T)

    @cached_property
    def p(self) -> torch.Tensor:
        return self.logp.exp()

    @cached_property
    def below(self) -> torch.Tensor:
        """Where the drafter's probability is at most the target's (TV's gradient set)."""
        return self.q <= self.p

    @cached_property
    def overlap(self) -> torch.Tensor:
        """``alpha = sum min(p, q)`` per row at the distillation temperature: the acceptance rate."""
        return torch.minimum(self.p, self.q).sum(-1)

    @cached_property
    def tv(self) -> torch.Tensor:
        """``sum |p - q| / 2`` per row: the rejection rate, formed from the differences themselves."""
        return (self.p - self.q).abs().sum(-1).mul_(0.5)


class Term(NamedTuple):
    name: str
    needs_target: bool
    fn: Callable[[Chunk], tuple[torch.Tensor, torch.Tensor]]


TERMS: dict[str, Term] = {}


def term(name: str, needs_target: bool):
    """Register a term function under ``name`` (see the module contract)."""

    def register(fn):
        TERMS[name] = Term(name, needs_target, fn)
        return fn

    return register


def combine(weights: dict[str, float], chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_k w_k value_k [c], sum_k w_k grad_k [c, V])`` over the terms with a weight > 0."""
    value, grad = None, None
    for name, w in weights.items():
        if w <= 0:
            continue
        if name not in TERMS:
            raise DflashError(f"train.loss term {name!r} is unknown; use some of {', '.join(TERMS)}")
        v, g = TERMS[name].fn(chunk)
        if value is None:
            value, grad = v * w, (g if w == 1.0 else g.mul_(w))
        else:
            value = value + v * w
            grad.add_(g, alpha=w)
    if value is None:
        raise DflashError(f"train.loss={weights}: no term has a weight > 0")
    return value, grad


def needs_target(weights: dict[str, float]) -> bool:
    """Whether any weighted term needs the target's logits."""
    return any(w > 0 and TERMS[n].needs_target for n, w in weights.items() if n in TERMS)


LN2 = math.log(2.0)

# the families (importing registers their terms)
from dflash_staged.train.objective.terms import acceptance, ce, divergence  # noqa: E402, F401
