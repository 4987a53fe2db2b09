"""A draft vocabulary: the drafter's head over the ``N`` target tokens that carry most of the loss.

Contract (``dflash plan`` chooses it, the trainer and ``dflash eval`` use it, the checkpoint carries it):

* **Choice** (:func:`choose`). Over the planned samples, count every token at a position with
  ``loss_mask = 1`` (the tokens the drafter is trained to propose). The vocabulary is the ``N`` most
  frequent, ties to the lower id, then sorted by target id; tokens never seen fill the rest in id
  order when fewer than ``N`` were seen. ``coverage`` is the share of loss-bearing tokens inside. The
  choice is a pure function of the counts and ``N``: ``plan`` records the counts in the manifest
  (:func:`counts_record`, key ``loss_tokens``), so every host's trainer, and a replay that sets another
  ``drafter.draft_vocab_size``, choose the same table without the data.
* **The drafter's head** is the target's frozen head restricted to those rows, in that order: draft id
  ``i`` is target id ``ids[i]``. A checkpoint stores it as ``lm_head.weight [N, H]`` beside ``d2t [N]``
  (int64), EAGLE-3's offsets ``ids[i] - i``, and ``draft_vocab_size: N`` in ``config.json``: what vLLM's
  DFlash and DSpark models (``draft_id_to_target_id``) and llama.cpp's converter (absolute ids, unique,
  in range) read. No ``t2d`` is stored (both engines skip it).
* **Training** (:mod:`dflash_staged.train.objective`): a label outside the vocabulary masks its row (its
  count is reported as ``draft_vocab_oov``); the target's distribution is restricted to the vocabulary
  and renormalised there: from its last layer exactly (its logits over the ``N`` rows), from its stored
  top-k with the ids outside dropped and the tail's mass taken as all inside (an upper bound on the
  tail's share; :meth:`~dflash_staged.model.drafters.target_dist.TopK.restrict`).
* **Decoding** drafts over the ``N`` rows and maps each draft back (:func:`to_target`); a proposal
  distribution is over those ``N`` target ids (zero elsewhere), so rejection sampling stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_staged.errors import DflashError


@dataclass(frozen=True)
class DraftVocab:
    """The chosen ids (sorted target ids) and what they cover of the planned data's loss tokens."""

    ids: np.ndarray  # [N] int64, ascending
    loss_tokens: int  # loss-bearing tokens counted
    covered: int  # of which inside the vocabulary
    seen: int  # distinct loss-bearing tokens

    @property
    def size(self) -> int:
        return int(self.ids.size)

    @property
    def coverage(self) -> float:
        return self.covered / self.loss_tokens if self.loss_tokens else 1.0

    def line(self, vocab_size: int) -> str:
        """One line for ``plan`` and the trainer."""
        return (
            f"draft vocabulary: {self.size:,} of {vocab_size:,} tokens cover {self.coverage:.2%} of "
            f"{self.loss_tokens:,} loss tokens ({self.seen:,} distinct seen); labels outside are masked"
        )


def counts_record(counts: np.ndarray) -> dict:
    """The loss-token counts as the manifest keeps them (JSON, sparse): any size is chosen from it."""
    seen = np.flatnonzero(counts)
    return {"vocab_size": int(counts.size), "ids": seen.tolist(), "counts": counts[seen].tolist()}


def counts_of(record: dict) -> np.ndarray:
    counts = np.zeros(int(record["vocab_size"]), dtype=np.int64)
    counts[np.asarray(record["ids"], dtype=np.int64)] = np.asarray(record["counts"], dtype=np.int64)
    return counts


def loss_token_counts(tokens: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """``[V]`` counts of the tokens at loss-bearing positions (``tokens``, ``loss_mask``: the planned
    samples, concatenated)."""
    on = np.asarray(tokens, dtype=np.int64)[np.asarray(loss_mask) > 0]
    if on.size and (int(on.max()) >= vocab_size or int(on.min()) < 0):
        raise DflashError(
            f"data: token id {int(on.max())} is outside the target vocabulary 0..{vocab_size - 1}"
        )
    return np.bincount(on, minlength=vocab_size).astype(np.int64)


def coverage(counts: np.ndarray, sizes) -> dict[int, float]:
    """The share of loss tokens the ``n`` most frequent ids cover, for each ``n`` of ``sizes``."""
    c = np.sort(counts)[::-1].cumsum()
    total = max(int(c[-1]) if c.size else 0, 1)
    return {int(n): float(c[min(int(n), c.size) - 1]) / total for n in sizes if n >= 1}


def choose(counts: np.ndarray, n: int) -> DraftVocab:
    """The ``n`` most frequent ids of ``counts`` (ties: lower id first), sorted; see the contract."""
    V = counts.size
    if not 1 <= n < V:
        raise DflashError(f"drafter.draft_vocab_size={n}: use 1..{V - 1} (0 = the whole vocabulary of {V})")
    order = np.lexsort((np.arange(V), -counts))  # by count descending, then id ascending
    ids = np.sort(order[:n]).astype(np.int64)
    return DraftVocab(ids, int(counts.sum()), int(counts[ids].sum()), int((counts > 0).sum()))


def check_ids(ids: torch.Tensor, n: int, vocab_size: int, where: str) -> torch.Tensor:
    """``ids`` as ``[n]`` int64 distinct target ids in range, or one line naming ``where``."""
    ids = torch.as_tensor(ids).long().reshape(-1)
    if ids.numel() != n:
        raise DflashError(f"{where}: the draft vocabulary has {ids.numel()} ids, draft_vocab_size is {n}")
    if ids.device.type == "meta":  # (shapes only: dflash memory)
        return ids
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise DflashError(f"{where}: draft vocabulary ids must lie in 0..{vocab_size - 1}")
    if torch.unique(ids).numel() != ids.numel():
        raise DflashError(f"{where}: the draft vocabulary repeats a target id")
    return ids


def d2t_of(ids: torch.Tensor) -> torch.Tensor:
    """The stored table: ``ids[i] - i`` (int64)."""
    return ids.long() - torch.arange(ids.numel(), device=ids.device)


def ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids from a stored ``d2t``."""
    return d2t.long() + torch.arange(d2t.numel(), device=d2t.device)


def t2d_of(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[V]`` int64: each target id's draft id, -1 outside the vocabulary."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    return t2d.scatter_(0, ids.long(), torch.arange(ids.numel(), device=ids.device))
