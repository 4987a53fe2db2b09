"""DSpark's training objective, as DeepSpec's ``compute_dspark_loss`` over its ``Qwen3DSparkModel``
forward (SpecForge's ``dspark_*_alpha`` the same weights).

Contract (one microbatch; the anchors come from :mod:`dflash_staged.train.objective`'s rule, which is
DeepSpec's: ``loss_mask`` on the anchor and on the next token):

* **Rows.** Every block row ``k = 0..B-1`` is a proposal for the token at ``a + k + 1``. A row counts
  while it and every earlier row of its block lie inside the sequence with ``loss_mask = 1`` (a
  cumulative product, DeepSpec's ``eval_mask``) and weighs ``exp(-k / gamma)`` (``train.gamma``).
* **Logits.** ``u_k`` = the head's logits of the final-normed state (through the target's logit
  transform) plus the Markov bias of the data's previous token (teacher forcing,
  :mod:`.heads`). The target's ``p_k`` = softmax of its own logits at ``a + k`` (its stored last
  layer, its final norm and head), or its stored top-k with the tail as one bucket
  (:mod:`dflash_staged.model.drafters.target_dist`: the L1 term is then the bucketed one).
* **Terms**, each a weighted sum over the rows: ``ce_weight`` x CE of ``u_k`` on the label,
  ``l1_weight`` x ``sum |softmax(u_k) - p_k|`` (twice the total variation), and ``confidence_weight``
  x the confidence head's BCE against ``1 - TV = clamp(1 - L1 / 2, 0, 1)`` (detached). DeepSpec
  divides each by the same weight sum; the trainer divides the step's sum by its total weight, the
  same thing. The confidence head's gradient reaches the backbone and the Markov embedding, as in
  the reference.
* **Memory.** The head runs over ``loss_chunk`` rows at a time, each chunk recomputed in the backward
  (:func:`torch.utils.checkpoint.checkpoint`): no ``[rows, V]`` tensor outlives its chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_staged.model.drafters.dspark.heads import confidence_logits
from dflash_staged.model.drafters.family import FamilyBatch, FamilyRows
from dflash_staged.model.drafters.layers import transform_logits
from dflash_staged.model.drafters.target_dist import topk_logp


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


def _chunk(h, m, w2, labels, tpos, top_ids, top_logp, last, drafter, target_norm):
    """One chunk of rows: (ce, l1, acceptance (detached), hits, target hits). The target's
    distribution from its last layer, or (``top_ids``) from its top-k (:mod:`..target_dist`)."""
    c, W = drafter.dcfg, drafter.lm_head_weight
    with torch.autocast(h.device.type, enabled=False):
        u = transform_logits((h.to(W.dtype) @ W.t()).float(), c.output_multiplier, c.final_logit_softcapping)
        if m is not None:
            u = u + (m.to(w2.dtype) @ w2.t()).float()
        if top_ids is None:
            x = target_norm(last[tpos]).to(W.dtype)
            t = transform_logits((x @ W.t()).float(), c.output_multiplier, c.final_logit_softcapping)
    logq = torch.log_softmax(u, -1)
    if top_ids is None:
        p, argmax = torch.softmax(t, -1), t.argmax(-1)
    else:
        p, argmax = topk_logp(logq.exp(), top_ids, top_logp).exp(), top_ids[:, 0].long()
    ce = -logq.gather(1, labels[:, None])[:, 0]
    l1 = (logq.exp() - p).abs().sum(-1)
    accept = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    top = u.detach().argmax(-1)
    return ce, l1, accept, top == labels, top == argmax


def dspark_objective(fb: FamilyBatch) -> tuple[torch.Tensor, FamilyRows]:
    d = fb.drafter
    o, B = d.dcfg.options, d.block_size
    out = d.forward_train(fb.taps, fb.input_ids, fb.cu, fb.anchors, attention=fb.attention)  # [A, B, H]
    labels, valid, prev, idx = block_rows(fb, B)
    k = torch.arange(B, device=out.device, dtype=torch.float32)
    w = valid * torch.exp(-k / fb.gamma)[None]
    head = getattr(d, "markov_head", None)
    m = e = None
    if head is not None:
        m, e = head.latents(prev, out)
    conf = confidence_logits(d, out, e)
    R, H = valid.numel(), out.shape[-1]
    h, mf = out.reshape(R, H), None if m is None else m.reshape(R, -1)
    w2 = head.markov_w2.weight if head is not None else None
    parts = []
    for s in range(0, R, max(1, fb.loss_chunk)):
        sl = slice(s, min(R, s + max(1, fb.loss_chunk)))
        tpos = idx.reshape(-1)[sl] - 1
        top = (None, None) if fb.topk is None else (fb.topk[0][tpos], fb.topk[1][tpos])
        args = (h[sl], None if mf is None else mf[sl], w2, labels.reshape(-1)[sl], tpos, *top)
        fn = lambda *a: _chunk(*a, fb.last, d, fb.target_norm)  # noqa: E731
        grad = torch.is_grad_enabled()
        parts.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    ce, l1, accept, hits, t_hits = (torch.cat(x).view(valid.shape) for x in zip(*parts))
    ce_sum, l1_sum = (w * ce).sum(), (w * l1).sum()
    total = o["ce_weight"] * ce_sum + o["l1_weight"] * l1_sum
    extra = {"dspark_ce_sum": ce_sum.detach(), "dspark_l1_sum": l1_sum.detach()}
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
        conf_sum = (w * bce).sum()
        total = total + o["confidence_weight"] * conf_sum
        err = (torch.sigmoid(conf.detach()) - accept).abs()
        extra.update(dspark_confidence_sum=conf_sum.detach(), dspark_confidence_err_sum=(w * err).sum())
    rows = FamilyRows(w.sum(), total.detach(), hits, valid, t_hits, accept, extra)
    return total, rows
