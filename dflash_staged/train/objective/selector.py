"""DFlash2's selector term of the objective and its training metrics.

Contract (called by :func:`dflash_staged.train.objective.dflash_loss` for a drafter with a selector):

* **Candidates** are the strict top ``selector_top_k`` of the head's transformed logits at each block
  offset (the serving set; from the same chunked pass as the DFlash term, :mod:`.head`).
* **Term.** At offset ``k`` the predecessor is the true previous token (the anchor's at offset 1:
  teacher forcing) and the selector's scores over the candidates get a ``K``-way cross-entropy with
  the label's index (the label: the data's next token, or the target's argmax with
  ``train.selector_labels = "target"``, as vLLM speculators trains it), on rows whose label is
  valid and among the candidates ("covered"); other rows carry no selector gradient (a miss is the
  backbone's recall failure). The objective weighs the rows with the DFlash term's position weights
  and the same denominator. With ``stop_gradient`` the unary logits and the drafter state enter the
  term detached: it trains the selector only.
* **Metrics** (no gradient): ``covered`` (top-k recall), ``selector_hits`` (the selector's argmax
  is the label, given the true predecessor, on covered rows) and ``walk_hits ``: the greedy walk
  from the true anchor on its *own* choices (what serving does), whose leading run of hits is the
  training proxy of served tau.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dflash_staged.model.drafters.dflash2.modules import CandidateSelector
from dflash_staged.train.objective.head import HeadRows, top_values


class SelectorRows(NamedTuple):
    ce: torch.Tensor  # [P] K-way cross-entropy, 0 where not covered
    covered: torch.Tensor  # [P] bool: the label is valid and among the candidates
    hits: torch.Tensor  # [P] bool: the selector's argmax is the label (covered rows)
    walk_hits: torch.Tensor  # [A, B-1] bool: the greedy walk's choice is the label


def selector_rows(
    selector: CandidateSelector,
    h: torch.Tensor,
    weight: torch.Tensor,
    head: HeadRows,
    labels: torch.Tensor,
    valid: torch.Tensor,
    prev: torch.Tensor,
    stop_gradient: bool = False,
    chunk: int = 4096,
) -> SelectorRows:
    """The term's rows for states ``h [A, B-1, H]``, ``labels``/``valid``/``prev`` ``[A, B-1]`` (``prev``
    = the true token before each offset) and the head's rows over ``h`` flattened."""
    A, L, H = h.shape
    flat = h.reshape(-1, H)
    cand = head.top_ids
    unary = head.top_vals if stop_gradient else top_values(flat, weight, head, chunk)
    gate = selector.gate(prev.reshape(-1), flat.detach() if stop_gradient else flat)
    scores = selector.scores(unary, cand, gate)  # [P, K]
    match = cand == labels.reshape(-1, 1)
    covered = match.any(-1) & valid.reshape(-1)
    idx = match.float().argmax(-1)
    ce = (torch.logsumexp(scores, -1) - scores.gather(1, idx[:, None])[:, 0]) * covered
    hits = (scores.detach().argmax(-1) == idx) & covered
    with torch.no_grad():
        k = cand.shape[1]
        path, _, _ = selector.walk_candidates(
            head.top_vals.view(A, L, k), cand.view(A, L, k), h.detach(), prev[:, 0]
        )
    return SelectorRows(ce, covered, hits, path == labels)


def alpha_at(step: int, total_steps: int, alpha: float, warmup_ratio: float, ramp_ratio: float) -> float:
    """The selector term's weight at ``step`` (0-based), as SpecForge schedules it: warmup and ramp in
    whole steps (``int(ratio x total_steps)``), 0 during the warmup, then ``alpha x (step - warmup +
    1) / ramp`` (so the ramp's first step already has ``alpha / ramp``), then ``alpha``."""
    if alpha <= 0:
        return alpha
    warmup = int(total_steps * warmup_ratio)
    if step < warmup:
        return 0.0
    ramp = int(total_steps * ramp_ratio)
    if ramp <= 0:
        return alpha
    return alpha * min(max((step - warmup + 1) / ramp, 0.0), 1.0)
