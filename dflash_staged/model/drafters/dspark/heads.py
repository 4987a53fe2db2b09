"""DSpark's two heads on top of the block backbone: the Markov head (a low-rank previous-token logit
bias) and the confidence head (each proposal's acceptance, predicted).

Contract (checkpoint names as DeepSpec's ``Qwen3DSparkModel`` and vLLM's and SGLang's DSpark models
load them):

* **Markov head** (``markov_head.*``): ``markov_w1`` an embedding ``[V, r]`` of the previous token,
  ``markov_w2`` a linear ``r -> N`` without bias (``markov_w2.weight [N, r]``; ``N`` the draft
  vocabulary, ``V`` without one, as vLLM's ``DSparkMarkovHead``; the previous token is always a target
  id). At proposal row ``k`` with backbone logits ``u_k``, final-normed state ``h_k`` and previous
  token ``x_{k-1}`` (row 0's is the anchor) the logits are ``u_k + markov_w2(m_k)`` with the latent ``m_k``:

  - ``vanilla``: ``m_k = w1[x_{k-1}]``;
  - ``gated``: ``m_k = sigmoid(gate_proj([h_k, w1[x_{k-1}]])) * w1[x_{k-1}]`` (``gate_proj``:
    ``H + r -> r`` with bias);
  - ``rnn``: a state ``s`` (0 before row 0): ``[g, c, o] = joint_proj([s, w1[x_{k-1}], h_k])``
    (``2r + H -> 3r`` with bias), ``s <- sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c)``,
    ``m_k = tanh(o)``.

  Training feeds the data's previous tokens (teacher forcing); decoding feeds the drafts, left to
  right (:func:`markov_walk`). ``markov_rank = 0``: no Markov head.
* **Confidence head** (``confidence_head.proj``, ``H (+ r) -> 1`` with bias): the logit of row
  ``k``'s acceptance from ``[h_k, w1[x_{k-1}]]`` (``confidence_head_with_markov``) or ``h_k``.
* **Init** as the reference's ``post_init``: N(0, 0.02) weights, zero biases.
"""

from __future__ import annotations

import torch
from torch import nn

VARIANTS = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int, hidden: int, kind: str, draft_vocab: int | None = None):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab or vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev.long())

    def step(self, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None):
        """One row: (latent ``m [..., r]``, the previous token's embedding, the rnn state)."""
        e = self.embed(prev)
        if self.kind == "vanilla":
            return e, e, state
        h = h.to(e.dtype)
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e, e, state
        s = e.new_zeros(e.shape) if state is None else state
        g, c, o = self.joint_proj(torch.cat([s, e, h], -1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        s = g * s + (1.0 - g) * torch.tanh(c)
        return torch.tanh(o), e, s

    def latents(self, prev: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced latents and embeddings of a block: ``prev [..., P]``, ``h [..., P, H]`` ->
        two ``[..., P, r]``."""
        if self.kind != "rnn":
            m, e, _ = self.step(prev, h, None)
            return m, e
        ms, es, s = [], [], None
        for k in range(prev.shape[-1]):
            m, e, s = self.step(prev[..., k], h[..., k, :], s)
            ms.append(m)
            es.append(e)
        return torch.stack(ms, -2), torch.stack(es, -2)

    def bias(self, m: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(m.to(self.markov_w2.weight.dtype))


class ConfidenceHead(nn.Module):
    def __init__(self, inputs: int):
        super().__init__()
        self.proj = nn.Linear(inputs, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1).float()


def confidence_logits(drafter, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor | None:
    """Each row's acceptance logit (None without a confidence head); ``e``: the previous tokens'
    Markov embeddings (used when the head takes them)."""
    head = getattr(drafter, "confidence_head", None)
    if head is None:
        return None
    if drafter.dcfg.options["confidence_head_with_markov"]:
        return head(torch.cat([h, e.to(h.dtype)], -1))
    return head(h)


@torch.no_grad()
def markov_walk(drafter, logits, hidden, anchor, temperature: float = 0.0, generator=None):
    """Decode one block as served: rows left to right, each row's logits plus the Markov bias of the
    previous choice (the anchor for row 0), greedy or drawn from ``softmax(logits / T)`` over the
    vocabulary. Returns (drafts ``[P]`` as rows of the head, draft ids with a draft vocabulary, the
    corrected logits ``[P, N]``, the confidence logits ``[P]`` or None)."""
    head = getattr(drafter, "markov_head", None)
    prev = torch.as_tensor(anchor, device=logits.device).long().reshape(())
    drafts, rows, embeds, s = [], [], [], None
    for k in range(logits.shape[0]):
        row = logits[k]
        if head is not None:
            m, e, s = head.step(prev, hidden[k], s)
            row = row + head.bias(m).to(row.dtype)
            embeds.append(e)
        if temperature > 0:
            p = torch.softmax(row.float() / temperature, -1)
            pick = torch.multinomial(p, 1, generator=generator)[0]
        else:
            pick = row.argmax(-1)
        drafts.append(pick)
        rows.append(row)
        prev = drafter.to_target(pick) if drafter.d2t is not None else pick  # (target ids)
    drafts = torch.stack(drafts)
    e = torch.stack(embeds) if embeds else None
    return drafts, torch.stack(rows), confidence_logits(drafter, hidden, e)
