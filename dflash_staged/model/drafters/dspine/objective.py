"""DSpine's training objective, as SpecForge's ``OnlineDSpineModel`` computes it
(``specforge/algorithms/dspine/model.py``) against the target's frozen distribution.

Contract (one microbatch; anchors by :mod:`dflash_staged.train.objective`'s rule):

* **Rows.** Block rows ``j = 1..B-1`` predict ``ids[a + j]``; row 0 is the anchor. A row counts while
  it and every earlier proposal row lie inside the sequence with ``loss_mask = 1`` (a cumulative
  product) and weighs ``exp(-(j - 1) / gamma)`` (``train.gamma``, SpecForge's ``loss_decay_gamma``).
* **Replacement** (scheduled sampling): each block is replaced with probability ``rho`` (drawn from
  the anchor generator); in a replaced block the first ``replacement_layers`` layers' injections take
  the data's previous token's code as predecessor (:mod:`.injection`). With the alignment weight
  ``beta``, ``rho`` follows :func:`schedule`.
* **Terms** (``ce_weight`` = ``c``), each weighted by the row weights and summed: the backbone's
  ``c x CE + (1 - c) x sum |softmax(u) - p|`` (``u`` the head's logits of the final state, ``p`` the
  target's distribution at ``a + j - 1``); the refinement over the top ``top_k`` candidates of ``u``
  (detached), scored by ``refine(pre_j, ids[a + j - 1]) . W[c]``; with the target's top-k instead of
  its last layer, a candidate's ``p`` is its stored probability, and 0 outside the stored ids (unknown;
  :mod:`dflash_staged.model.drafters.distill_head`), so the candidates' mass and the threshold count
  only the mass the store knows: ``c x`` its CE on the label when the
  label is a candidate (else 0) ``+ (1 - c) x`` its L1 to ``p`` renormalised over the candidates, where
  those hold more than ``candidate_mass_threshold`` of ``p``; and the alignment: ``1 - cos`` between
  every layer's feature and the label's code, summed over the layers, times ``beta x`` the batch's
  weighted-mean CE (detached). SpecForge takes that CE over the optimizer step's whole window on all
  ranks (a pre-pass); here it is the microbatch's own, which is the same when a step is one
  microbatch on one rank.
* **Memory and cost.** The backbone's terms and the candidates come from
  :mod:`dflash_staged.model.drafters.distill_head` (chunked, gradients formed in the same pass, no
  ``[rows, V]`` tensor kept); the refinement and alignment run over ``loss_chunk`` rows at a time,
  recomputed in the backward (only the candidates' head rows, nothing vocabulary-sized).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_staged.model.drafters.distill_head import HeadInputs, distill_head
from dflash_staged.model.drafters.dspine.injection import refine
from dflash_staged.model.drafters.family import FamilyBatch, FamilyRows


def schedule(opts: dict, step: int, total_steps: int) -> tuple[float, float]:
    """(alignment weight ``beta``, replacement probability ``rho``) at ``step`` of ``total_steps``:
    ``beta`` ramps linearly to ``alignment_weight`` over ``alignment_warmup_steps``; ``rho`` holds at
    ``replacement_probability`` until ``replacement_hold_ratio`` of the run, then falls linearly to 0 at
    ``replacement_end_ratio`` (0 when the run's length is unknown)."""
    warm = opts["alignment_warmup_steps"]
    beta = opts["alignment_weight"] * (min(max(step, 0) / warm, 1) if warm else 1)
    if not total_steps or total_steps <= 0:
        return beta, 0.0
    progress = max(step, 0) / total_steps
    end, hold = opts["replacement_end_ratio"], opts["replacement_hold_ratio"]
    return beta, opts["replacement_probability"] * min(max((end - progress) / (end - hold), 0), 1)


def _refinement(pre, feats, labels, prev, w, cand, p_cand, drafter):
    """One chunk of rows: the weighted refinement and alignment sums, and whether the label is a
    candidate. Nothing vocabulary-sized: the candidates' head rows only."""
    o, W = drafter.dcfg.options, drafter.lm_head_weight
    refined = refine(drafter, pre, prev)
    scores = torch.einsum("rh,rkh->rk", refined.to(W.dtype), F.embedding(cand, W)).float()
    logr = torch.log_softmax(scores, -1)
    mass = p_cand.sum(-1)
    covered = cand == labels[:, None]
    r_ce = -(logr * covered).sum(-1)
    r_l1 = (logr.exp() - p_cand / mass[:, None].clamp_min(1e-30)).abs().sum(-1)
    r_l1 = r_l1 * (mass > o["candidate_mass_threshold"])
    code = F.embedding(labels, drafter.transfer_codes).float()
    align = 1 - F.cosine_similarity(feats.float(), code[:, None, :], dim=-1)  # [rows, L]
    cw = o["ce_weight"]
    sums = torch.stack([(w * (cw * r_ce + (1 - cw) * r_l1)).sum(), (w[:, None] * align).sum()])
    return sums, covered.any(-1)


def dspine_objective(fb: FamilyBatch) -> tuple[torch.Tensor, FamilyRows]:
    d = fb.drafter
    o, B, dev = d.dcfg.options, d.block_size, fb.input_ids.device
    ids, cu, anchors, T = fb.input_ids, fb.cu, fb.anchors, fb.input_ids.shape[0]
    seq = torch.searchsorted(cu, anchors, right=True) - 1
    idx = anchors[:, None] + torch.arange(B, device=dev)  # rows 0..B-1: the anchor, then the labels
    idxc = idx.clamp(max=T - 1)
    tokens = ids[idxc]
    ok = (idx < cu[1:][seq][:, None]) & (fb.loss_mask[idxc] > 0)
    valid = ok[:, 1:].long().cumprod(1).bool()
    j = torch.arange(B - 1, device=dev, dtype=torch.float32)
    w = valid * torch.exp(-j / fb.gamma)[None]
    beta, rho = schedule(o, fb.step, fb.total_steps)
    replace = None
    if torch.is_grad_enabled() and rho > 0:
        gdev = fb.generator.device if fb.generator is not None else dev
        replace = (torch.rand(anchors.shape, generator=fb.generator, device=gdev).to(dev) < rho).to(dev)
    state = {"block_tokens": tokens, "replace": replace}
    out = d.forward_train(fb.taps, ids, cu, anchors, attention=fb.attention, state=state)
    rec = state["record"]
    H = out.shape[-1]
    h = out[:, 1:].reshape(-1, H)
    pre = rec["pre"][:, 1:].reshape(-1, H)
    feats = torch.stack(rec["features"], 1)[:, :, 1:].transpose(1, 2).reshape(h.shape[0], len(d.layers), -1)
    labels, prev = tokens[:, 1:].reshape(-1), tokens[:, :-1].reshape(-1)
    tpos, wf = (idxc[:, 1:] - 1).clamp(min=0).reshape(-1), w.reshape(-1)
    c, cw = d.dcfg, o["ce_weight"]
    x = HeadInputs(
        d.lm_head_weight, labels, wf, tpos, fb.last, fb.target_norm, fb.topk, c.output_multiplier,
        c.final_logit_softcapping, cw, 1 - cw, max(1, fb.loss_chunk), cand_k=o["top_k"],
    )  # fmt: skip
    backbone, ce, l1, overlap, hits, t_hits, cand, p_cand = distill_head(h, None, None, x)
    sums, covered = [], []
    step_rows = max(1, fb.loss_chunk)
    for s in range(0, h.shape[0], step_rows):
        sl = slice(s, s + step_rows)
        args = (pre[sl], feats[sl], labels[sl], prev[sl], wf[sl], cand[sl], p_cand[sl])
        fn = lambda *a: _refinement(*a, d)  # noqa: E731
        a, b = checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args)
        sums.append(a)
        covered.append(b)
    refinement, alignment = torch.stack(sums).sum(0)
    ce, l1 = (wf * ce).sum(), (wf * l1).sum()
    wsum = w.sum()
    scale = beta * (ce / wsum.clamp_min(1e-12))
    total = backbone + refinement + scale * alignment
    shape = valid.shape
    cov = torch.cat(covered).view(shape)
    extra = {
        "dspine_ce_sum": ce,
        "dspine_l1_sum": l1,
        "dspine_refinement_sum": refinement.detach(),
        "dspine_alignment_sum": alignment.detach(),
        "dspine_covered": (cov * valid).sum(),
        "dspine_counted": valid.sum().float(),
    }
    view = lambda v: v.view(shape)  # noqa: E731
    out_rows = FamilyRows(wsum, total.detach(), view(hits), valid, view(t_hits), view(overlap), extra)
    return total, out_rows
