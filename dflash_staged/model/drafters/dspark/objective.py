"""DSpark's training objective, as DeepSpec's ``compute_dspark_loss`` over its ``Qwen3DSparkModel``
forward (SpecForge's ``dspark_*_alpha`` the same weights).

Contract (one microbatch; the anchors come from :mod:`dflash_staged.train.objective`'s rule, which is
DeepSpec's: ``loss_mask`` on the anchor and on the next token):

* **Rows.** Every block row ``k = 0..B-1`` is a proposal for the token at ``a + k + 1``. A row counts
  while it and every earlier row of its block lie inside the sequence with ``loss_mask = 1`` (a
  cumulative product, DeepSpec's ``eval_mask``) and weighs ``exp(-k / gamma)`` (``train.gamma``); a
  label outside the draft vocabulary masks its row alone (:mod:`dflash_staged.model.drafters.vocab`).
* **Logits.** ``u_k`` = the head's logits of the final-normed state (through the target's logit
  transform) plus the Markov bias of the data's previous token (teacher forcing,
  :mod:`.heads`). The target's ``p_k`` = softmax of its own logits at ``a + k`` (its stored last
  layer, its final norm and head), or its stored top-k with the tail as one bucket
  (:mod:`dflash_staged.model.drafters.target_dist`: the L1 term is then the bucketed one).
* **Terms**, each a weighted sum over the rows: ``ce_weight`` x CE of ``u_k`` on the label,
  ``l1_weight`` x ``sum |softmax(u_k) - p_k|`` (twice the total variation), and ``confidence_weight``
  x the confidence head's BCE against the acceptance ``sum min(p, q) = 1 - TV`` (detached; from a
  top-k, exact on the ids and half the store's bound on the tail:
  :mod:`dflash_staged.model.drafters.distill_head`).
  DeepSpec divides each by the same weight sum; the trainer divides the step's sum by its total weight, the
  same thing. The confidence head's gradient reaches the backbone and the Markov embedding, as in
  the reference.
* **Memory and cost.** The head runs over ``loss_chunk`` rows at a time with its gradients formed in
  the same pass (:mod:`dflash_staged.model.drafters.distill_head`): no ``[rows, V]`` tensor outlives
  its chunk, and nothing is recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_staged.model.drafters.distill_head import HeadInputs, distill_head
from dflash_staged.model.drafters.dspark.heads import confidence_logits
from dflash_staged.model.drafters.family import FamilyBatch, FamilyRows


def block_rows(fb: FamilyBatch, B: int):
    """(labels ``[A, B]``, validity ``[A, B]``, previous tokens ``[A, B]``, label positions ``[A, B]``)."""
    ids, cu, anchors = fb.input_ids, fb.cu, fb.anchors
    T = ids.shape[0]
    seq = torch.searchsorted(cu, anchors, right=True) - 1
    idx = anchors[:, None] + torch.arange(1, B + 1, device=ids.device)
    inside = idx < cu[1:][seq][:, None]
    idxc = idx.clamp(max=T - 1)
    valid = (inside & (fb.loss_mask[idxc] > 0)).long().cumprod(1).bool()
    prev = torch.cat([ids[anchors][:, None], ids[idxc][:, :-1]], 1)
    return torch.where(valid, ids[idxc], 0), valid, prev, idxc


def dspark_objective(fb: FamilyBatch) -> tuple[torch.Tensor, FamilyRows]:
    d = fb.drafter
    o, B = d.dcfg.options, d.block_size
    out = d.forward_train(fb.taps, fb.input_ids, fb.cu, fb.anchors, attention=fb.attention)  # [A, B, H]
    labels, valid, prev, idx = block_rows(fb, B)
    labels, trained, outside = d.draft_labels(labels, valid)  # (a draft vocabulary masks rows)
    k = torch.arange(B, device=out.device, dtype=torch.float32)
    w = trained * torch.exp(-k / fb.gamma)[None]
    head = getattr(d, "markov_head", None)
    m = e = None
    if head is not None:
        m, e = head.latents(prev, out)
    conf = confidence_logits(d, out, e)
    R, H = valid.numel(), out.shape[-1]
    c = d.dcfg
    x = HeadInputs(
        d.lm_head_weight, labels.reshape(-1), w.reshape(-1), idx.reshape(-1) - 1, fb.last, fb.target_norm,
        fb.topk, c.output_multiplier, c.final_logit_softcapping, o["ce_weight"], o["l1_weight"],
        max(1, fb.loss_chunk),
    )  # fmt: skip
    w2 = head.markov_w2.weight if head is not None else None
    total, *per_row = distill_head(out.reshape(R, H), None if m is None else m.reshape(R, -1), w2, x)
    ce, l1, accept, hits, t_hits = (v.view(valid.shape) for v in per_row[:5])
    hits = hits & trained  # (a label outside the draft vocabulary is a miss)
    ce_sum, l1_sum = (w * ce).sum(), (w * l1).sum()
    extra = {"dspark_ce_sum": ce_sum.detach(), "dspark_l1_sum": l1_sum.detach(), "label_oov": outside}
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
        conf_sum = (w * bce).sum()
        total = total + o["confidence_weight"] * conf_sum
        err = (torch.sigmoid(conf.detach()) - accept).abs()
        extra.update(dspark_confidence_sum=conf_sum.detach(), dspark_confidence_err_sum=(w * err).sum())
    rows = FamilyRows(w.sum(), total.detach(), hits, valid, t_hits, accept, extra)
    return total, rows
