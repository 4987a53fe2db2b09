"""The target's logits and log-probabilities over the vocabulary, written once for every route.

Contract (extract's top-k, the trainer's heads and every term over the vocabulary form them here):

* :func:`transform_logits`: the target's logit scaling, ``s * tanh(m * x / s)`` with a softcap
  ``s > 0``, else ``m * x``. ``m`` and ``s`` are the run's ``[drafter] output_multiplier`` and
  ``final_logit_softcapping``: the drafter's logits, the target's recomputed from its stored last
  layer and the target's stored top-k all go through the same two numbers.
* :func:`target_logits`: the target's next-token logits from its last decoder layer's outputs (before
  its final norm): ``transform(head(norm(last)))`` in fp32. The trainer (from a stored last layer) and
  extract (for the stored top-k) both call it, so the two routes see the same scale and softcap.
* :func:`log_probs`: ``x - logsumexp(x)`` over the last axis, with the maximum's own term kept out of
  the normaliser's sum (``log1p``). PyTorch's CPU ``log_softmax`` and ``softmax`` accumulate the
  normaliser in a way that loses up to ~1e-4 of a peaked row's top log-probability at a 152K
  vocabulary (measured: 1.4e-4 against 2.5e-6 for ``x - logsumexp(x)``), so nothing over the
  vocabulary that feeds a stored value or a term uses them.
* :func:`declared_transform`: the scaling a target's own ``config.json`` declares
  (``final_logit_softcapping``; ``logit_scale`` multiplies, ``logits_scaling`` divides), which
  :meth:`~dflash_staged.model.target.taps.Target` holds the run's settings to.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dflash_staged.errors import DflashError


def transform_logits(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """The target's logit scaling: ``s * tanh(m * logits / s)`` with a softcap ``s``, else ``m * logits``."""
    if softcap:
        return softcap * torch.tanh(logits * (multiplier / softcap))
    return logits * multiplier if multiplier != 1.0 else logits


def transform_slope(raw: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor | float:
    """``d transform / d raw`` at the raw logits (a float when constant)."""
    if softcap:
        return multiplier * (1 - torch.tanh(raw * (multiplier / softcap)).pow(2))
    return multiplier


def log_normaliser(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logsumexp(x)`` over the last axis as two ``[..., 1]`` parts ``(m, l)``: ``m = max(x)`` and
    ``l = log1p(sum of exp(x - m) but one maximum's)``, so that ``log p = (x - m) - l`` keeps a peaked
    row's digits (``-1e-6`` with logits near 30, where one float32 ``logsumexp`` rounds to ``9.5e-7``).
    One transient ``x``-sized tensor."""
    m, top = x.max(-1, keepdim=True)  # one pass for the maximum and where it is
    e = (x - m).exp_().scatter_(-1, top, 0.0)
    return m, torch.log1p(e.sum(-1, keepdim=True))


def log_probs(x: torch.Tensor) -> torch.Tensor:
    """``x - logsumexp(x)`` over the last axis, formed as ``(x - m) - l`` (:func:`log_normaliser`; see
    the module contract: not ``log_softmax``)."""
    m, lz = log_normaliser(x)
    return (x - m).sub_(lz)


def target_logits(
    last: torch.Tensor,
    norm: Callable[[torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
    multiplier: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """The target's transformed next-token logits ``[n, V]`` (fp32) from ``last [n, H]``, its last
    decoder layer's outputs: ``transform(head(norm(last)))``."""
    return transform_logits(head(norm(last)).float(), multiplier, softcap)


def topk_log_probs(
    last: torch.Tensor,
    norm: Callable[[torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
    k: int,
    temperature: float,
    transform: tuple[float, float | None],
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-``k`` next-token log-probabilities at ``temperature`` from the last decoder layer's outputs
    ``last [T, H]``: :func:`target_logits` with ``transform`` over the temperature, log-probabilities over
    the whole vocabulary in fp32 (:func:`log_probs`), ``chunk`` tokens at a time -> (ids ``[T, k]`` int32,
    most likely first; log-probabilities ``[T, k]`` float16; the log of the mass outside them ``[T]``
    float32, the logsumexp of the others': exact however small, ``-inf`` when ``k`` covers the vocabulary).
    Both extract engines form the stored top-k with it."""
    multiplier, softcap = transform
    n, dev = last.shape[0], last.device
    ids = torch.empty(n, k, dtype=torch.int32, device=dev)
    logp = torch.empty(n, k, dtype=torch.float16, device=dev)
    logtail = torch.empty(n, dtype=torch.float32, device=dev)
    for s in range(0, n, chunk):
        z = target_logits(last[s : s + chunk], norm, head, multiplier, softcap)
        lp = log_probs(z.div_(temperature))
        del z
        v, i = lp.topk(k, dim=-1)
        ids[s : s + chunk], logp[s : s + chunk] = i, v.clamp_min(-60000.0)
        logtail[s : s + chunk] = torch.logsumexp(lp.scatter_(1, i, float("-inf")), -1)
        del lp
    return ids, logp, logtail


def declared_transform(text_config) -> tuple[float, float]:
    """``(multiplier, softcap)`` as the target's (text) config declares them (softcap 0: none)."""
    multiplier = float(getattr(text_config, "logit_scale", None) or 1.0)
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling:
        multiplier /= float(scaling)
    return multiplier, float(getattr(text_config, "final_logit_softcapping", None) or 0.0)


def check_transform(
    declared: tuple[float, float], given: tuple[float, float | None] | None, target: str
) -> tuple[float, float]:
    """The run's ``(multiplier, softcap)``: ``given`` (None: the ``declared`` ones), refused in one line
    where it differs from what the target's config declares."""
    if given is None:
        return declared
    m, s = float(given[0]), float(given[1] or 0.0)
    if not (math.isclose(m, declared[0], rel_tol=1e-6) and math.isclose(s, declared[1], rel_tol=1e-6)):
        raise DflashError(
            f"target {target}: its config.json scales its logits by {declared[0]:g} with softcap "
            f"{declared[1]:g} (0: none), but [drafter] output_multiplier = {m:g} and final_logit_softcapping "
            f"= {s:g}: set them to {declared[0]:g} and {declared[1]:g}, so that the drafter's logits, the "
            "stored top-k and serving are all formed as the target forms its own"
        )
    return m, s
