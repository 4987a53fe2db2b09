"""One microbatch's loss: the drafter's forward over the anchors' blocks, the chunked head with the
weighted terms, the position weights, DFlash2's selector term, and the statistics (the rules:
:mod:`dflash_staged.train.objective`)."""

from __future__ import annotations

from typing import Any

import torch

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.family import FamilyBatch, FamilyRows
from dflash_staged.model.drafters.target_dist import TopK
from dflash_staged.train.objective.anchors import add_noise, block_labels, sample_anchors
from dflash_staged.train.objective.head import TargetRows, TopkRows, head_rows
from dflash_staged.train.objective.metrics import block_acceptance, expected_acceptance, zero_stats
from dflash_staged.train.objective.selector import selector_rows
from dflash_staged.train.objective.terms import needs_target
from dflash_staged.train.objective.weights import decay_weights, dpace_weights


def _field(batch: Any, name: str) -> torch.Tensor:
    if isinstance(batch, dict):
        return batch[name]
    return getattr(batch, name)


def split_hidden(drafter, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A shard's ``hidden [T, K', H]`` as (the taps ``[T, K, H]``, the target's last layer ``[T, H]`` or
    None): ``K' = K + 1`` when the store holds the last layer (see :mod:`dflash_staged.store`)."""
    k = len(drafter.dcfg.target_layer_ids)
    if hidden.shape[1] == k:
        return hidden, None
    if hidden.shape[1] == k + 1:
        return hidden[:, :k], hidden[:, k]
    raise DflashError(
        f"batch: hidden holds {hidden.shape[1]} layers a token; the drafter reads {k} taps (and the "
        "target's last layer after them when the store has it): the shard does not fit this drafter"
    )


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
    return (row_weights.float() * rows.loss).sum() / d, wsum, rows.hits


def _denom(wsum: torch.Tensor, denom, dev) -> torch.Tensor:
    """What a microbatch's loss sum is divided by: its weight sum by default, else ``denom``."""
    return wsum.clamp_min(1e-6) if denom is None else torch.as_tensor(denom, dtype=torch.float32, device=dev)


def family_stats(drafter, rows: FamilyRows, A: int) -> dict[str, torch.Tensor]:
    """The standard statistics (and the family's own sums) from a family objective's rows."""
    dev = rows.valid.device
    stats = zero_stats(drafter.proposals + 1, dev, torch.float32, extra=drafter.family.stats)
    accepted, blocks = block_acceptance(rows.hits, rows.valid)
    stats.update(
        correct=(rows.hits & rows.valid).sum(0),
        total=rows.valid.sum(0),
        loss_sum=rows.main_sum,
        weight_sum=rows.weight_sum,
        accepted=accepted,
        blocks=blocks,
        num_anchors=torch.tensor(A, device=dev),
        **rows.extra,
    )
    if rows.target_hits is not None:
        stats.update(
            target_correct=(rows.target_hits & rows.valid).sum(0),
            target_total=rows.valid.sum(0),
            target_accepted=block_acceptance(rows.target_hits, rows.valid)[0],
        )
    if rows.alpha is not None:
        stats.update(
            overlap=(rows.alpha * rows.valid).sum(0),
            expected_accepted=expected_acceptance(rows.alpha, rows.valid),
        )
    return stats


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
    terms: dict[str, float] | None = None,
    target_norm: torch.nn.Module | None = None,
    distill_temperature: float = 1.0,
    lk_eta: float = 3.0,
    selector_labels: str = "data",
    step: int = 0,
    total_steps: int = 0,
    target_topk: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one microbatch and its stats (see :mod:`dflash_staged.train.objective`).

    ``terms``: ``train.loss`` (default ``{"ce": 1.0}``). ``target_norm``: the target's final norm; given
    (and the batch holding the target's last layer), the target's logits are recomputed for every
    row, for the terms that need them and for the target metrics. ``target_topk`` (not None; the batch
    holding the target's top-k): the target's distribution from its first ``target_topk`` stored
    entries (0: all) instead, where the store holds no last layer."""
    terms = terms or {"ce": 1.0}
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
    taps, last = split_hidden(drafter, hidden)
    full = last is not None and target_norm is not None
    topk = None
    if not full and target_topk is not None and isinstance(batch, dict) and "topk_ids" in batch:
        tail = batch.get("topk_logtail")  # (None in a store written before the tail was kept)
        topk = TopK(
            batch["topk_ids"].to(dev), batch["topk_logprobs"].to(dev), None if tail is None else tail.to(dev)
        ).first(target_topk)
        if drafter.d2t is not None:  # over the draft vocabulary, renormalised
            topk = topk.restrict(drafter.t2d)
    fam = drafter.family
    if fam.needs_target and not (full or topk is not None):
        raise DflashError(
            f"drafter.architecture={fam.name!r} learns from the target's distribution: the store must hold "
            "its last layer ([target] store_last_layer = true) or its top-k ([target] store_topk)"
        )
    wants_target = fam.objective is None and (needs_target(terms) or selector_labels == "target")
    if wants_target and not (full or topk is not None):
        raise DflashError(
            f"train.loss={terms} (selector_labels={selector_labels!r}) needs the target's distribution: the "
            "store must hold its last layer ([target] store_last_layer = true) or its top-k ([target] "
            "store_topk)"
        )
    B = drafter.block_size
    anchors = sample_anchors(loss_mask, cu, B, num_anchors, generator)
    A = anchors.shape[0]
    if A == 0:
        loss = sum(p.sum() for p in drafter.parameters() if p.requires_grad) * 0.0
        return loss, zero_stats(drafter.proposals + 1, dev, extra=fam.stats)
    taps = add_noise(taps, noise_std, generator)
    if fam.objective is not None:
        fb = FamilyBatch(
            drafter, taps, input_ids, loss_mask, cu, anchors, last if full else None, target_norm, attention,
            step, total_steps, loss_chunk, generator, gamma, topk,
        )  # fmt: skip
        total, rows = fam.objective(fb)
        return total / _denom(rows.weight_sum, denom, dev), family_stats(drafter, rows, A)
    out = drafter.forward_train(taps, input_ids, cu, anchors, attention=attention)[:, 1:]  # [A, B-1, H]
    labels, valid = block_labels(input_ids, loss_mask, cu, anchors, B)
    labels, trained, outside = drafter.draft_labels(labels, valid)  # (a draft vocabulary masks rows)
    target = None
    pos = (anchors[:, None] + torch.arange(B - 1, device=dev)).clamp(max=hidden.shape[0] - 1).reshape(-1)
    if full:
        target = TargetRows(last, pos, target_norm)
    elif topk is not None:
        target = TopkRows(topk, pos)
    selector, c = getattr(drafter, "selector", None), drafter.dcfg
    head = head_rows(
        out.reshape(-1, out.shape[-1]),
        drafter.lm_head_weight,
        labels.reshape(-1),
        loss_chunk,
        c.output_multiplier,
        c.final_logit_softcapping,
        selector.top_k if selector is not None else 0,
        terms=terms,
        target=target,
        temperature=distill_temperature,
        lk_eta=lk_eta,
        target_label=needs_target(terms),
    )
    if position_weights == "dpace":
        w = dpace_weights(head.p_label.view(A, B - 1), trained, dpace_alpha)
    else:
        w = decay_weights(B, gamma, dev)[None, :] * trained
    wsum = w.sum()
    used = _denom(wsum, denom, dev)
    main = (w.reshape(-1) * head.loss).sum()
    hits = head.hits.view(A, B - 1) & trained  # (a label outside the draft vocabulary is a miss)
    accepted, blocks = block_acceptance(hits, valid)
    stats = zero_stats(B, dev, torch.float32)
    stats.update(
        correct=(hits & valid).sum(0),
        total=valid.sum(0),
        loss_sum=main.detach(),
        weight_sum=wsum,
        accepted=accepted,
        blocks=blocks,
        num_anchors=torch.tensor(A, device=dev),
        label_oov=outside,
    )
    if target is not None:
        t_hits = head.target_hits.view(A, B - 1)
        alpha = head.overlap.view(A, B - 1)
        stats.update(
            target_correct=(t_hits & valid).sum(0),
            target_total=valid.sum(0),
            overlap=(alpha * valid).sum(0),
            target_accepted=block_acceptance(t_hits, valid)[0],
            expected_accepted=expected_acceptance(alpha, valid),
        )
        if head.top_mass.numel():
            stats["top_mass"] = (head.top_mass.view(A, B - 1) * valid).sum(0)
    total = main
    if selector is not None:
        idx = (anchors[:, None] + torch.arange(B - 1, device=dev)).clamp(max=input_ids.shape[0] - 1)
        sel_labels = head.target_ids.view(A, B - 1) if selector_labels == "target" else labels
        rows = selector_rows(
            selector,
            out,
            drafter.lm_head_weight,
            head,
            sel_labels,
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
