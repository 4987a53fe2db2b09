"""Cross-entropy terms: on the data's next token (``ce``, DFlash's objective) and on the target's own
argmax (``ce_target``: vLLM speculators' DFlash default, "CE on the verifier's argmax"). Both at
temperature 1; the gradient of ``lse(u) - u[y]`` is ``softmax(u) - onehot(y)``. The value is read
off the drafter's normaliser in two parts (:func:`~dflash_staged.model.target.logits.log_normaliser`),
which keeps a confident row's small CE to its own digits."""

from __future__ import annotations

import torch

from dflash_staged.train.objective.terms import Chunk, term


def _ce(c: Chunk, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    value = -c.logq1_at(y)
    grad = c.q1.clone()
    grad.scatter_add_(1, y[:, None], -torch.ones_like(value)[:, None])
    return value, grad


@term("ce", needs_target=False)
def ce(c: Chunk):
    """Cross-entropy of the data's next token."""
    return _ce(c, c.labels)


@term("ce_target", needs_target=True)
def ce_target(c: Chunk):
    """Cross-entropy of the target's most likely next token (its greedy choice)."""
    return _ce(c, c.target_ids)
