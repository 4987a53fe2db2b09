"""The objective's statistics: what one microbatch counts (summed over microbatches and ranks, no
host sync) and the metrics a step logs from the sums (``metrics.jsonl``, :mod:`dflash_staged.train.metrics`).

* **Per offset** (``[B-1]``): ``correct``/``total`` (top-1 against the data label), DFlash2's
  ``selector_correct``/``covered``; with the target's logits ``target_correct``/``target_total``
  (the drafter's argmax is the target's) and the sums ``overlap`` (``sum min(p, q)`` at T = 1) and
  ``top_mass`` (the target's probability on DFlash2's top-k candidates).
* **Scalars**: ``loss_sum`` (the weighted loss of the main term), ``selector_loss_sum``,
  ``weight_sum``, ``accepted``/``blocks`` (see :func:`block_acceptance`), ``walk_accepted``
  (DFlash2's greedy walk), ``target_accepted`` (the greedy run against the target's argmax, as
  greedy serving counts it), ``expected_accepted`` (the expected accepted length under sampling at
  T = 1: ``sum_k prod_{j <= k} alpha_j`` a block, as DSpark's tau), ``num_anchors`` and ``label_oov``
  (labels outside the draft vocabulary: masked in the loss, misses in the counts; ``draft_vocab_oov``
  is their share of ``total``).
* **Acceptance length** per block, as a cumulative product of hits (:func:`block_acceptance`,
  SpecForge's rule): a block accepts its leading run of correct top-1 predictions; an invalid label
  (past the end, or ``loss_mask = 0``) neither breaks the run nor counts. ``tau = 1 + accepted /
  blocks``: tokens committed per verify step *including* the bonus token the target always adds, as
  the reference ``dflash`` benchmark counts it (its ``acceptance_length + 1``).
"""

from __future__ import annotations

import torch

PER_OFFSET = ("correct", "total", "selector_correct", "covered", "target_correct", "target_total")
PER_OFFSET_SUMS = ("overlap", "top_mass")
SCALARS = (
    "loss_sum",
    "weight_sum",
    "selector_loss_sum",
    "accepted",
    "blocks",
    "walk_accepted",
    "num_anchors",
    "target_accepted",
    "expected_accepted",
    "label_oov",
)


def zero_stats(block_size: int, device, dtype=torch.float64, extra=()) -> dict[str, torch.Tensor]:
    """Every statistic at zero (the accumulator a step sums microbatches into): per-offset ones over
    ``block_size - 1`` proposal rows (pass the drafter's ``proposals + 1``), and the scalars, with a
    family's own (``extra``)."""
    z = torch.zeros(block_size - 1, dtype=dtype, device=device)
    s = torch.zeros((), dtype=dtype, device=device)
    out = {k: z.clone() for k in PER_OFFSET + PER_OFFSET_SUMS}
    out.update({k: s.clone() for k in SCALARS + tuple(extra)})
    return out


def block_acceptance(hits: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block accepted lengths from top-1 ``hits [A, B-1]`` and label validity ``valid [A, B-1]``:
    (sum of accepted lengths, number of blocks with a valid label); see the module contract."""
    run = torch.cumprod((hits | ~valid).long(), dim=1) * valid
    return run.sum(), valid.any(dim=1).sum()


def expected_acceptance(alpha: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Sum over blocks of the expected accepted length under sampling, ``sum_k prod_{j <= k} alpha_j``,
    from each offset's acceptance rate ``alpha [A, B-1]`` (invalid offsets neither break nor count)."""
    run = torch.cumprod(torch.where(valid, alpha.double(), torch.ones_like(alpha, dtype=torch.float64)), 1)
    return (run * valid).sum()


def per_offset_accuracy(correct, total) -> list[float]:
    """Top-1 accuracy per block offset from summed counts (0 where nothing was counted)."""
    c = torch.as_tensor(correct).double().cpu()
    t = torch.as_tensor(total).double().cpu()
    return (c / t.clamp_min(1)).tolist()


def training_tau(accepted, blocks) -> float:
    """Acceptance length from summed per-block stats: ``1 + accepted / blocks`` (includes the bonus token)."""
    return 1.0 + float(accepted) / max(float(blocks), 1.0)


def selector_metrics(stats: dict) -> dict:
    """DFlash2's metrics from summed stats: the selector term's weighted mean, its accuracy given the
    true predecessor and the top-k recall per offset, and the greedy walk's acceptance length; with
    the target's logits, the target's probability mass on the top-k per offset."""
    out = {
        "selector_loss": float(stats["selector_loss_sum"] / stats["weight_sum"].clamp_min(1e-12)),
        "selector_acc": per_offset_accuracy(stats["selector_correct"], stats["covered"]),
        "topk_recall": per_offset_accuracy(stats["covered"], stats["total"]),
        "walk_tau": training_tau(stats["walk_accepted"], stats["blocks"]),
    }
    if float(torch.as_tensor(stats["target_total"]).sum()) > 0:
        out["topk_mass"] = per_offset_accuracy(stats["top_mass"], stats["target_total"])
    return out


def target_metrics(stats: dict) -> dict:
    """With the target's logits (else {}): per offset the greedy agreement with the target
    (``target_acc``) and the expected acceptance under sampling (``overlap``, the T = 1 analogue);
    the greedy acceptance length against the target (``target_tau``) and the expected one at T = 1
    (``expected_tau``)."""
    if float(torch.as_tensor(stats["target_total"]).sum()) <= 0:
        return {}
    return {
        "target_acc": per_offset_accuracy(stats["target_correct"], stats["target_total"]),
        "target_tau": training_tau(stats["target_accepted"], stats["blocks"]),
        "overlap": per_offset_accuracy(stats["overlap"], stats["target_total"]),
        "expected_tau": training_tau(stats["expected_accepted"], stats["blocks"]),
    }
