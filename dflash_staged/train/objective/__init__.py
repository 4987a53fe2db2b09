"""The DFlash training objective: anchors, labels, the weighted block loss of ``train.loss`` and its
metrics.

Contract (the trainer calls :func:`dflash_loss` once per microbatch):

* **Batch.** Anything with ``hidden [T, K, H]``, ``input_ids [T]``, ``loss_mask [T]``
  (1 = train on this token) and ``cu_seqlens [N+1]`` (packed sequences), as attributes or mapping
  keys: a shard from :mod:`dflash_staged.store` fits. When the store holds the target's last layer,
  ``hidden`` has one more slice after the taps (:func:`~.loss.split_hidden`): the drafter reads the
  taps, the head the last layer.
* **Anchors** (:mod:`.anchors`). Per sequence, up to ``num_anchors`` positions drawn uniformly
  without replacement from the candidates: positions ``t`` with ``loss_mask[t] = 1`` whose next
  token ``t+1`` is inside the sequence and has ``loss_mask = 1`` (SpecForge's rule: no block without
  a label at offset 1; a block may run past the end of the sequence, so the end of every answer is
  trained too). Drawn afresh at every call from ``generator`` (so a seeded generator replays the
  same anchors).
* **Labels.** Block offset ``k`` (1..B-1) predicts ``ids[anchor+k]`` with no shift; a label counts
  when it lies inside the sequence and its ``loss_mask`` is 1. Offset 0 (the anchor token itself)
  carries no loss. The target's distribution for that row is its next-token distribution at
  position ``anchor+k-1``, recomputed from the stored last layer with the target's final norm and
  head (:mod:`.head`); it counts at the same rows.
* **Loss.** At each row the weighted sum of ``train.loss``'s terms (:mod:`.terms`: ``ce`` on the
  data's label, ``ce_target``, ``kl``, ``rkl``, ``jsd``, ``tv``, ``lk``, ``lk_alpha`` on the
  target's distribution), weighted per offset by ``w_k`` (:mod:`.weights`):
  ``position_weights="decay"``: ``exp(-(k-1)/gamma)``; ``"dpace"``: D-PACE's detached weights from
  the drafter's own probability of each label (the target's argmax when a term on the target is in
  the loss, else the data's); 0 for invalid labels. For a DFlash2 drafter, plus ``selector_alpha``
  x the selector's top-k cross-entropy with the same weights (:mod:`.selector`; its label is the
  data's, or the target's argmax with ``train.selector_labels = "target"``). The sum is divided by
  ``denom``: by default this microbatch's weight sum (a weighted mean). The trainer passes
  ``denom=1`` (the weighted sum), sums gradients over microbatches and ranks and divides them by
  the optimizer step's total weight over all ranks
  (:meth:`dflash_staged.train.optim.Optimizer.reduce_gradients`), so every label of the step weighs
  the same however the step's tokens were split into microbatches. The LM head runs in chunks of
  ``loss_chunk`` rows (:mod:`.head`): logits, the drafter's or the target's, never exist for more
  than one chunk, in the forward or the backward.
* **Stats and metrics**: :mod:`.metrics` (tensors on the batch's device, no host sync; summed over
  microbatches and ranks).
"""

from dflash_staged.train.objective.anchors import (
    add_noise,
    anchor_counts,
    block_labels,
    noise_std_at,
    sample_anchors,
)
from dflash_staged.train.objective.loss import dflash_loss, head_loss, split_hidden
from dflash_staged.train.objective.metrics import (
    PER_OFFSET,
    block_acceptance,
    expected_acceptance,
    per_offset_accuracy,
    selector_metrics,
    target_metrics,
    training_tau,
    zero_stats,
)
from dflash_staged.train.objective.weights import decay_weights, dpace_weights

__all__ = [
    "PER_OFFSET",
    "add_noise",
    "anchor_counts",
    "block_acceptance",
    "block_labels",
    "decay_weights",
    "dflash_loss",
    "dpace_weights",
    "expected_acceptance",
    "head_loss",
    "noise_std_at",
    "per_offset_accuracy",
    "sample_anchors",
    "selector_metrics",
    "split_hidden",
    "target_metrics",
    "training_tau",
    "zero_stats",
]
