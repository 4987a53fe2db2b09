"""The DFlash training objective: anchors, labels, the decayed block loss and its metrics.

Contract (the trainer calls :func:`dflash_loss` once per microbatch):

* **Batch.** Anything with ``hidden [T, K, H]``, ``input_ids [T]``, ``loss_mask [T]``
  (1 = train on this token) and ``cu_seqlens [N+1]`` (packed sequences), as
  attributes or mapping keys: a shard from :mod:`dflash_staged.store` fits.
* **Anchors.** Per sequence, up to ``num_anchors`` positions drawn uniformly without
  replacement from the candidates: positions ``t`` with ``loss_mask[t] = 1`` whose next
  token ``t+1`` is inside the sequence and has ``loss_mask = 1`` (SpecForge's rule: no
  block without a label at offset 1; a block may run past the end of the sequence, so
  the end of every answer is trained too). Drawn afresh at every call from ``generator``
  (so a seeded generator replays the same anchors).
* **Labels.** Block offset ``k`` (1..B-1) predicts ``ids[anchor+k]`` with no shift;
  a label counts when it lies inside the sequence and its ``loss_mask`` is 1.
  Offset 0 (the anchor token itself) carries no loss.
* **Loss.** Cross-entropy of the head's (transformed) logits, weighted per offset by ``w_k``:
  ``position_weights="decay"``: ``exp(-(k-1)/gamma)``; ``"dpace"``: D-PACE's detached weights
  from the drafter's own probability of each label (:func:`dpace_weights`); 0 for invalid
  labels. For a DFlash2 drafter, plus ``selector_alpha`` x the selector's top-k cross-entropy
  with the same weights (:mod:`dflash_staged.train.selector_loss`). The sum is divided by
  ``denom``: by default this microbatch's weight sum (a weighted mean). The
  trainer passes ``denom=1`` (the weighted sum), sums gradients over microbatches and
  ranks and divides them by the optimizer step's total weight over all ranks
  (:meth:`dflash_staged.train.optim.Optimizer.reduce_gradients`), so every label of the
  step weighs the same however the step's tokens were split into microbatches.
  The LM head runs in chunks of ``loss_chunk`` positions (:mod:`dflash_staged.train.head`):
  logits never exist for more than one chunk, in the forward or the backward.
* **Stats** (tensors on the batch's device, no host sync): per offset ``correct``/``total``
  (top-1 counts), ``covered`` (label among the selector's candidates) and ``selector_correct``;
  ``loss_sum`` (the weighted CE sum of the DFlash term), ``selector_loss_sum``, ``weight_sum``,
  ``accepted``/``blocks`` (see below), ``walk_accepted`` (the same for the selector's greedy
  walk) and ``num_anchors``; the selector's are 0 without one. Sum them over
  microbatches/ranks, then :func:`per_offset_accuracy` and :func:`training_tau`.
* **Acceptance length** per block, as a cumulative product of hits
  (:func:`block_acceptance`, SpecForge's rule): a block accepts its leading run of
  correct top-1 predictions; an invalid label (past the end, or ``loss_mask = 0``)
  neither breaks the run nor counts. ``tau = 1 + accepted / blocks`` over the blocks with
  a valid label: tokens committed per verify step *including* the bonus token the target
  always adds, as the reference ``dflash`` benchmark counts it (its ``acceptance_length + 1``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dflash_staged.errors import DflashError
from dflash_staged.train.head import head_rows
from dflash_staged.train.selector_loss import selector_rows


def _field(batch: Any, name: str) -> torch.Tensor:
    if isinstance(batch, dict):
        return batch[name]
    return getattr(batch, name)


def _candidates(loss_mask: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's sequence index, whether it may be an anchor) under the contract's rule."""
    dev, T = loss_mask.device, loss_mask.shape[0]
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=dev), lengths, output_size=T)
    end = cu[1:][seq]  # exclusive end of each token's sequence
    nxt = torch.cat([loss_mask[1:], loss_mask.new_zeros(1)]) > 0
    return seq, (loss_mask > 0) & nxt & (torch.arange(T, device=dev) + 1 < end)


def anchor_counts(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, num_anchors: int) -> list[int]:
    """How many anchors :func:`sample_anchors` draws from each sequence (whatever the generator):
    each anchor is one block of ``block_size`` drafter rows, so this sizes a microbatch's memory."""
    cu = cu_seqlens.to(device=loss_mask.device, dtype=torch.long)
    seq, cand = _candidates(loss_mask, cu)
    per_seq = torch.zeros(cu.numel() - 1, dtype=torch.long).index_add_(0, seq.cpu(), cand.long().cpu())
    return per_seq.clamp_max(num_anchors).tolist()


def sample_anchors(
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sorted packed indices of the anchors: up to ``num_anchors`` per sequence (see contract)."""
    dev = loss_mask.device
    T = loss_mask.shape[0]
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    seq, cand = _candidates(loss_mask, cu)
    gdev = generator.device if generator is not None else dev
    r = torch.rand(T, generator=generator, device=gdev).to(dev)
    # Sort by (sequence, candidate first, random key): the first num_anchors of each run win.
    key = seq.double() * 4 + torch.where(cand, r.double(), r.double() + 2)
    order = torch.argsort(key)
    rank = torch.arange(T, device=dev) - cu[:-1][seq]  # rank within the sequence, in `order`
    chosen = order[(rank < num_anchors) & cand[order]]
    return chosen.sort().values


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``[A, B-1]`` for offsets 1..B-1 and their validity mask (inside the sequence and
    ``loss_mask = 1``). Invalid labels are 0."""
    dev = input_ids.device
    T = input_ids.shape[0]
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    seq = torch.searchsorted(cu, anchors, right=True) - 1
    idx = anchors[:, None] + torch.arange(1, block_size, device=dev)
    valid = idx < cu[1:][seq][:, None]
    idx = idx.clamp(max=T - 1)
    valid &= loss_mask[idx] > 0
    return torch.where(valid, input_ids[idx], 0), valid


def decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """``exp(-(k-1)/gamma)`` for k = 1..B-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def head_loss(
    h: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    row_weights: torch.Tensor,
    loss_chunk: int = 4096,
    denom=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted CE of the LM head over rows ``h [P, H]`` divided by ``denom`` (default: the weight
    sum, a weighted mean); returns (loss, weight_sum, hits [P])."""
    rows = head_rows(h, lm_head_weight, labels, loss_chunk)
    wsum = row_weights.float().sum()
    d = (
        wsum.clamp_min(1e-6)
        if denom is None
        else torch.as_tensor(denom, dtype=torch.float32, device=h.device)
    )
    return (row_weights.float() * rows.ce).sum() / d, wsum, rows.hits


def dpace_weights(p_label: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE position weights ``[A, B-1]`` from the drafter's probability of each label (detached):
    ``w_j = sum_{m >= j} prod_{i <= m} q_i`` with ``q = (1 - alpha) p + alpha``, over valid offsets
    (an invalid one neither breaks the product nor adds a term), 0 at invalid offsets."""
    q = torch.where(valid, (1 - alpha) * p_label.detach().float() + alpha, torch.ones_like(p_label).float())
    terms = torch.cumprod(q, dim=1) * valid
    return terms.flip(1).cumsum(1).flip(1) * valid


def add_noise(hidden: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Target features plus N(0, std^2) noise (drawn on the generator's device)."""
    if std <= 0:
        return hidden
    gdev = generator.device if generator is not None else hidden.device
    noise = torch.randn(hidden.shape, generator=generator, device=gdev, dtype=torch.float32)
    return (hidden.float() + std * noise.to(hidden.device)).to(hidden.dtype)


def block_acceptance(hits: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block accepted lengths from top-1 ``hits [A, B-1]`` and label validity ``valid [A, B-1]``:
    (sum of accepted lengths, number of blocks with a valid label); see the module contract."""
    run = torch.cumprod((hits | ~valid).long(), dim=1) * valid
    return run.sum(), valid.any(dim=1).sum()


def _zero_stats(drafter, dev) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = sum(p.sum() for p in drafter.parameters() if p.requires_grad) * 0.0
    zeros = torch.zeros(drafter.block_size - 1, dtype=torch.long, device=dev)
    zero = torch.zeros((), device=dev)
    none = torch.zeros((), dtype=torch.long, device=dev)
    stats = {k: zeros.clone() for k in PER_OFFSET}
    stats.update({k: zero.clone() for k in ("loss_sum", "weight_sum", "selector_loss_sum")})
    stats.update({k: none.clone() for k in ("accepted", "blocks", "walk_accepted", "num_anchors")})
    return loss, stats


PER_OFFSET = ("correct", "total", "selector_correct", "covered")


def dflash_loss(
    drafter,
    batch: Any,
    num_anchors: int,
    gamma: float,
    generator: torch.Generator | None = None,
    noise_std: float = 0.0,
    loss_chunk: int = 4096,
    denom=None,
    attention="sdpa",
    *,
    position_weights: str = "decay",
    dpace_alpha: float = 0.5,
    selector_alpha: float = 1.0,
    selector_stop_gradient: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DFlash loss of one microbatch and its stats (see the module contract)."""
    hidden = _field(batch, "hidden")
    dev = hidden.device
    input_ids = _field(batch, "input_ids").to(dev)
    loss_mask = _field(batch, "loss_mask").to(dev)
    cu = _field(batch, "cu_seqlens").to(device=dev, dtype=torch.long)
    if cu.numel() < 2 or int(cu[-1]) != hidden.shape[0] or input_ids.shape[0] != hidden.shape[0]:
        raise DflashError(
            f"batch: cu_seqlens ends at {int(cu[-1]) if cu.numel() else None} but hidden has "
            f"{hidden.shape[0]} rows and input_ids {input_ids.shape[0]}; the shard is inconsistent"
        )
    B = drafter.block_size
    anchors = sample_anchors(loss_mask, cu, B, num_anchors, generator)
    A = anchors.shape[0]
    if A == 0:
        return _zero_stats(drafter, dev)
    hidden = add_noise(hidden, noise_std, generator)
    out = drafter.forward_train(hidden, input_ids, cu, anchors, attention=attention)[:, 1:]  # [A, B-1, H]
    labels, valid = block_labels(input_ids, loss_mask, cu, anchors, B)
    selector, c = getattr(drafter, "selector", None), drafter.dcfg
    head = head_rows(
        out.reshape(-1, out.shape[-1]),
        drafter.lm_head_weight,
        labels.reshape(-1),
        loss_chunk,
        c.output_multiplier,
        c.final_logit_softcapping,
        selector.top_k if selector is not None else 0,
    )
    if position_weights == "dpace":
        w = dpace_weights(head.p_label.view(A, B - 1), valid, dpace_alpha)
    else:
        w = decay_weights(B, gamma, dev)[None, :] * valid
    wsum = w.sum()
    used = wsum.clamp_min(1e-6) if denom is None else torch.as_tensor(denom, dtype=torch.float32, device=dev)
    main = (w.reshape(-1) * head.ce).sum()
    hits = head.hits.view(A, B - 1)
    accepted, blocks = block_acceptance(hits, valid)
    _, stats = _zero_stats(drafter, dev)
    stats.update(
        correct=(hits & valid).sum(0),
        total=valid.sum(0),
        loss_sum=main.detach(),
        weight_sum=wsum,
        accepted=accepted,
        blocks=blocks,
        num_anchors=torch.tensor(A, device=dev),
    )
    total = main
    if selector is not None:
        idx = (anchors[:, None] + torch.arange(B - 1, device=dev)).clamp(max=input_ids.shape[0] - 1)
        rows = selector_rows(
            selector,
            out,
            drafter.lm_head_weight,
            head,
            labels,
            valid,
            input_ids[idx],
            selector_stop_gradient,
            loss_chunk,
        )
        sel = (w.reshape(-1) * rows.ce).sum()
        total = total + selector_alpha * sel
        stats.update(
            selector_loss_sum=sel.detach(),
            selector_correct=rows.hits.view(A, B - 1).sum(0),
            covered=rows.covered.view(A, B - 1).sum(0),
            walk_accepted=block_acceptance(rows.walk_hits, valid)[0],
        )
    return total / used, stats


def noise_std_at(step: int, total_steps: int, noise_std: float, schedule: str = "constant") -> float:
    """Noise level at ``step``: constant, or decayed linearly / by a half cosine to 0 at ``total_steps``."""
    if noise_std <= 0:
        return 0.0
    frac = min(max(step / max(total_steps, 1), 0.0), 1.0)
    if schedule == "constant":
        return noise_std
    if schedule == "linear":
        return noise_std * (1.0 - frac)
    if schedule == "cosine":
        return noise_std * 0.5 * (1.0 + math.cos(math.pi * frac))
    raise DflashError(f"train.noise_schedule={schedule!r}: use constant, linear or cosine")


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
    true predecessor and the top-k recall per offset, and the greedy walk's acceptance length."""
    return {
        "selector_loss": float(stats["selector_loss_sum"] / stats["weight_sum"].clamp_min(1e-12)),
        "selector_acc": per_offset_accuracy(stats["selector_correct"], stats["covered"]),
        "topk_recall": per_offset_accuracy(stats["covered"], stats["total"]),
        "walk_tau": training_tau(stats["walk_accepted"], stats["blocks"]),
    }
