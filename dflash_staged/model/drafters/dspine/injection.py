"""DSpine's modules: adjacent causal injection between draft layers, the fixed token codes it reads from
the target's head, and the refined candidate path its decoding walks.

Contract (names and arithmetic as SpecForge's ``specforge/modeling/draft/dspine.py``; ``r`` =
``transfer_rank``, ``M`` = ``message_size``):

* **Transfer space** (buffers ``transfer_codes [V, r]``, ``transfer_ready``): from the target's head
  ``W [V, H]``: rows normalised, centred by their mean, the top ``r`` principal directions ``D [H, r]``
  (eigenvalues ``l``) of their scatter; a token's code is ``normalize((w - mean) D / sqrt(l))``;
  each layer's readout starts as ``D^T``. Computed once, at init, in fp32; saved with the weights.
* **Injection** (``injection.*``), after decoder layer ``i`` on the block rows ``x [..., B, H]``:
  the feature ``f = sqrt(r) normalize(readouts[i](x))``; row ``j``'s predecessor is
  ``sqrt(r) codes[anchor]`` for ``j = 1`` and ``f_{j-1}`` after (the previous row's feature at this
  layer; in training, the first ``replacement_layers`` layers of a replaced block take the data's
  previous token's code instead); rows ``j >= 1`` become
  ``x_j + ||x_j|| / sqrt(H) * writes[i](g * message(pred))`` with the gate
  ``g = sigmoid(receiver_gate(f_j) + predecessor_gate(pred) + bias)``; row 0 is unchanged. ``writes``
  and ``predecessor_gate`` start at zero (the injection starts as the identity), ``message`` and
  ``receiver_gate`` with PyTorch's default init. The pass records the last layer's rows before its
  injection (``pre``) and every layer's feature after it (``features``).
* **Refinement**: ``refine(pre_j, p) = norm(write(pre_j, f(pre_j), sqrt(r) codes[p]))`` at the last
  layer, for a predecessor token ``p``; a candidate ``c`` then scores ``refine(...) . W[c]``.
* **Walk** (decoding): the candidates of row ``j`` are the top ``top_k`` of its logits; left to right,
  row ``j``'s scores over its candidates take the previous row's choice as predecessor (row 1's: the
  anchor); greedy = argmax (SpecForge's ``select_cached``), at ``T > 0`` a draw from
  ``softmax(scores / T)`` over the candidates, which is the proposal (SpecForge serves greedy only).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class AdjacentInjection(nn.Module):
    def __init__(self, hidden: int, layers: int, rank: int, message: int, replacement_layers: int):
        super().__init__()
        self.rank, self.replacement_layers = rank, replacement_layers
        self.readouts = nn.ModuleList(nn.Linear(hidden, rank, bias=False) for _ in range(layers))
        self.writes = nn.ModuleList(nn.Linear(message, hidden, bias=False) for _ in range(layers))
        self.message = nn.Linear(rank, message, bias=False)
        self.receiver_gate = nn.Linear(rank, message, bias=False)
        self.predecessor_gate = nn.Linear(rank, message, bias=False)
        self.bias = nn.Parameter(torch.zeros(message))

    def reset_parameters(self) -> None:
        self.message.reset_parameters()
        self.receiver_gate.reset_parameters()
        with torch.no_grad():
            for w in self.writes:
                w.weight.zero_()
            self.predecessor_gate.weight.zero_()
            self.bias.zero_()

    def feature(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        return (math.sqrt(self.rank) * F.normalize(self.readouts[layer](x).float(), dim=-1)).to(x.dtype)

    def code(self, tokens: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        return math.sqrt(self.rank) * F.embedding(tokens, codes)

    def write(self, x, receiver, predecessor, layer: int) -> torch.Tensor:
        gate = torch.sigmoid(self.receiver_gate(receiver) + self.predecessor_gate(predecessor) + self.bias)
        delta = self.writes[layer](gate * self.message(predecessor))
        scale = (torch.linalg.vector_norm(x.float(), dim=-1, keepdim=True) / math.sqrt(x.shape[-1])).to(
            x.dtype
        )
        return x + scale * delta

    def forward(self, x, layer: int, tokens, codes, replace=None) -> torch.Tensor:
        f = self.feature(x, layer)
        pred = torch.cat([self.code(tokens[..., :1], codes), f[..., 1:-1, :]], -2)
        if replace is not None and layer < self.replacement_layers:
            true = self.code(tokens[..., :-1], codes)
            pred = torch.where(replace[..., None, None], true, pred)
        return torch.cat([x[..., :1, :], self.write(x[..., 1:, :], f[..., 1:, :], pred, layer)], -2)


@torch.no_grad()
def transfer_space(head: torch.Tensor, rank: int, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes ``[V, r]``, directions ``[H, r]``) of the target's head (see the module contract)."""
    V, H = head.shape
    scatter = torch.zeros(H, H, dtype=torch.float32, device=head.device)
    total = scatter.new_zeros(H)
    for rows in head.split(chunk):
        n = F.normalize(rows.float(), dim=-1)
        total += n.sum(0)
        scatter += n.T @ n
    mean = total / V
    scatter -= V * torch.outer(mean, mean)
    values, directions = torch.linalg.eigh(scatter)
    values, directions = values[-rank:], directions[:, -rank:]
    if not torch.isfinite(values).all() or (values <= 0).any():
        raise ValueError(
            f"the target's head has fewer than transfer_rank={rank} positive principal directions"
        )
    codes = torch.empty(V, rank, dtype=torch.float32, device=head.device)
    for s in range(0, V, chunk):
        n = F.normalize(head[s : s + chunk].float(), dim=-1)
        codes[s : s + chunk] = F.normalize((n - mean) @ directions / values.sqrt(), dim=-1)
    return codes, directions


def refine(drafter, pre: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
    """Refined final states of rows ``pre [..., H]`` given predecessor tokens ``[...]``."""
    inj, last = drafter.injection, len(drafter.layers) - 1
    receiver = inj.feature(pre, last)
    pred = inj.code(predecessors, drafter.transfer_codes)
    return drafter.norm(inj.write(pre, receiver, pred, last))


@torch.no_grad()
def refined_walk(drafter, logits, pre, anchor, temperature: float = 0.0, generator=None):
    """The refined candidate path of one block's proposal rows: ``logits [P, V]``, ``pre [P, H]`` ->
    (drafts ``[P]``, candidates ``[P, K]``, each choice's distribution ``[P, K]``, one-hot when greedy)."""
    K = drafter.dcfg.options["top_k"]
    cand = logits.topk(min(K, logits.shape[-1]), dim=-1).indices  # [P, K]
    W = drafter.lm_head_weight
    prev = torch.as_tensor(anchor, device=logits.device).long().reshape(())
    drafts, probs = [], []
    for j in range(cand.shape[0]):
        h = refine(drafter, pre[j], prev)
        s = (h.to(W.dtype) @ W[cand[j]].t()).float()
        if temperature > 0:
            q = torch.softmax(s / temperature, -1)
            idx = torch.multinomial(q, 1, generator=generator)[0]
        else:
            idx = s.argmax(-1)
            q = F.one_hot(idx, s.shape[-1]).float()
        prev = cand[j, idx]
        drafts.append(prev)
        probs.append(q)
    return torch.stack(drafts), cand, torch.stack(probs)
