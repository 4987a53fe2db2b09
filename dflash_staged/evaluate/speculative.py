"""Speculative decoding with a DFlash drafter (greedy, or sampled with lossless rejection
sampling), and its acceptance length.

Contract (as the reference z-lab ``dflash_generate``; the tests hold it to it):

* **Prefill.** The target runs the prompt ``p[0..P-1]`` once with a KV cache and the taps; its
  last logits give the first new token, committed at position ``P``. The context is the taps of
  positions ``0..P-1``.
* **Step.** The *anchor* is the last committed token, at position ``s``; its features are not
  known yet (the target has not run it). The proposer sees the taps of positions ``0..s-1`` and
  the committed tokens ``0..s`` and proposes up to ``B-1`` tokens after the anchor, ``B`` being the
  proposer's ``block_size`` (the verified block: ``B-1`` drafts for a DFlash drafter of block ``B``,
  ``B`` for a DSpark drafter of block ``B``, whose block rows are all proposals). The target
  verifies ``[anchor, d_1 .. d_n]`` (positions ``s..s+n``) in one forward with the cache. With
  ``a`` = the longest prefix of drafts equal to the target's argmax, the step commits
  ``d_1..d_a`` plus the target's own next token (the *bonus*): ``a + 1`` tokens, so the output is
  exactly plain greedy decoding. The taps of the verified positions ``s..s+a`` join the context;
  the cache keeps positions ``0..s+a`` (dense caches are cropped; a hybrid linear-attention cache
  is deep-copied before the verify and, unless every draft was accepted, the copy re-runs the
  ``a + 1`` verified tokens). The next anchor is the bonus. A proposer may return fewer drafts
  than ``B-1`` (DSpark's confidence-scheduled length); ``verified`` records ``n + 1`` per step.
* **Sampling** (``sampler`` with a temperature > 0, :mod:`dflash_staged.evaluate.sampling`,
  whose docstring is that contract): the first new token is drawn from the target's distribution
  ``p``; each step the proposer draws its drafts with their proposal ``q`` and the verify accepts
  ``a`` of them by rejection sampling, then draws the step's last token from the residual (first
  rejection) or from ``p`` after the last draft (the bonus). The step commits ``a + 1`` tokens as
  above, and the output is distributed exactly as sampling the target token by token.
  ``sampler=None`` or temperature 0 is the greedy step above.
* **Stop** after ``max_new_tokens`` new tokens or at a stop token (output ends with it). The last
  blocks are shortened as the reference ``dflash_generate`` does: with ``r`` new tokens still to
  come, the verified block is ``[anchor, d_1 .. d_n]`` with ``n = min(B-1, r)`` drafts, the proposer
  drafts that shorter block (a proposer with ``sized = True`` runs its drafter on ``n + 1``
  positions, which changes the drafts under bidirectional attention; others, DSpark's as its
  reference, draft the full block and are truncated), and the step commits at most ``r`` tokens: a
  bonus past ``max_new_tokens`` is discarded.
* **Acceptance length** ``tau`` = tokens committed per verify step (prefill token excluded):
  1.0 without a drafter, at most ``B``. Per-position rate ``k`` (1..B-1) = share of verify
  steps that committed draft ``k``, so ``tau = 1 + sum(rates)``.
* A *proposer* is anything with ``block_size`` (int), ``reset()`` (called once per prompt) and
  ``propose(context [S, K, H], tokens [S+1]) -> LongTensor [n]``, the greedy drafts; to sample
  it also takes ``propose(context, tokens, sampler)`` (a
  :class:`~dflash_staged.evaluate.sampling.Sampler`, its ``temperature`` > 0, its generator for
  every draw) and returns ``(drafts [n], q)``, ``q`` the proposal the drafts were drawn from:
  dense ``[n, V]`` or ``SparseQ(ids [n, K], probs [n, K])``. :class:`DrafterProposer`
  wraps a drafter; tests inject oracles.
* **DrafterProposer's drafts** come from the drafter's family
  (:meth:`~dflash_staged.model.drafters.family.Family.walk`) over the block's proposal rows (their
  logits through the drafter's logit transform and their final-normed states): DFlash2's selector
  walk, DSpark's Markov head left to right, DSpine's refined candidate path; each greedy at
  temperature 0, else a draw with its proposal. A family without a walk (DFlash v1): greedy =
  argmax of the block's logits, sampled = drawn from ``q`` over the vocabulary (dense q,
  :meth:`~dflash_staged.evaluate.sampling.Sampler.propose`). With a draft vocabulary the walk runs over
  its rows and the drafts are mapped back to target ids; a sampled proposal becomes sparse on the
  vocabulary's target ids (:mod:`dflash_staged.model.drafters.vocab`).
* **Drafter cache.** :class:`DrafterProposer` keeps the drafter's context keys/values in a
  :class:`~dflash_staged.model.drafters.backbone.DraftCache` of the committed positions: each step
  computes them only for the positions verified since the last one, and a cache longer than
  the context it is handed is cropped to it, as the reference crops its draft
  ``DynamicCache`` to the committed length. The drafts are those of recomputing the whole
  context every step (``kv_cache=False``).
* **Reporting** (:func:`acceptance_stats`): ``tau`` pooled over all verify steps; the
  reference ``dflash`` benchmark reports the mean over prompts of each prompt's mean, which
  :func:`dflash_staged.evaluate.report.run_eval` reports beside it.
"""

from __future__ import annotations

import copy
from typing import NamedTuple, Protocol

import torch

from dflash_staged.evaluate.sampling import SparseQ, proposal_rows
from dflash_staged.model.drafters.backbone import DraftCache


class Proposer(Protocol):
    block_size: int

    def reset(self) -> None: ...

    def propose(self, context: torch.Tensor, tokens: torch.Tensor, sampler=None): ...


class DrafterProposer:
    """Drafts of a drafter through its family's walk (DFlash v1's rule when the family has none),
    greedy or sampled. The context is fused once per position; with ``kv_cache`` (default) its
    keys/values are cached too, else recomputed every step. ``propose(..., size=n)`` drafts a block of
    ``n`` positions (a family whose blocks start with a proposal, DSpark, drafts full blocks and the
    caller truncates, as its reference does). ``walk_options`` go to the family's walk (DSpark:
    ``confidence_threshold``)."""

    def __init__(self, drafter, kv_cache: bool = True, **walk_options):
        self.drafter = drafter.eval()
        self.family = drafter.family
        self.block_size = drafter.proposals + 1  # the verified block: the anchor and every proposal
        self.drafter_block_size = drafter.block_size  # the drafter's own (DSpark's: its proposals)
        self.sized = drafter.first_row == 1
        self.device = drafter.fc.weight.device
        self.kv_cache = kv_cache
        self.walk_options = walk_options
        self.reset()

    def reset(self) -> None:
        self._fused: torch.Tensor | None = None
        self._cache = DraftCache()

    def _draft(self, context: torch.Tensor, anchor: torch.Tensor, S: int, size: int | None, state: dict):
        """The block's proposal rows: ``(logits [P, V], hidden [P, H])``; ``size``: a shorter block."""
        extra = {"return_hidden": True, "size": size if self.sized else None, "state": state}
        if self.kv_cache:
            if self._cache.length > S:
                self._cache.crop(S)  # only committed positions stay
            new = context[self._cache.length : S].to(self.device)
            return self.drafter.draft_block(new, anchor, anchor_pos=S, cache=self._cache, **extra)
        n = 0 if self._fused is None else self._fused.shape[0]
        if n > S:
            self._fused, n = self._fused[:S], S
        if S > n:
            new = self.drafter.fuse_context(context[n:S].to(self.device))
            self._fused = new if self._fused is None else torch.cat([self._fused, new])
        return self.drafter.draft_block(self._fused, anchor, anchor_pos=S, fused=True, **extra)

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, tokens: torch.Tensor, sampler=None, size: int | None = None):
        S = context.shape[0]
        anchor = tokens[S].to(self.device)
        state: dict = {}
        logits, hidden = self._draft(context, anchor, S, size, state)
        sampled = sampler is not None and not sampler.greedy
        temperature = sampler.temperature if sampled else 0.0
        gen = sampler.generator(self.device) if sampled else None
        out = self.family.walk(
            self.drafter, logits, hidden, anchor, temperature, gen, state=state, **self.walk_options
        )
        if out is None:  # DFlash v1: the block's argmax, or a draw from its (filtered) logits
            out = sampler.propose(logits) if sampled else (logits.argmax(-1), None)
        drafts, q = out
        if self.drafter.d2t is not None:  # draft ids of a draft vocabulary -> target ids
            drafts = self.drafter.to_target(drafts)
        if not sampled:
            return drafts
        return drafts, self._target_q(SparseQ(*q) if isinstance(q, tuple) else q)

    def _target_q(self, q):
        """A proposal over the head's rows as one over target ids: with a draft vocabulary, sparse on the
        vocabulary's ids (zero elsewhere, so rejection sampling stays exact)."""
        if self.drafter.d2t is None:
            return q
        if isinstance(q, SparseQ):
            return SparseQ(self.drafter.to_target(q.ids), q.probs)
        ids = self.drafter.to_target(torch.arange(q.shape[-1], device=q.device))
        return SparseQ(ids.expand(q.shape[0], -1), q)


class SpecOutput(NamedTuple):
    tokens: list[int]  # the new tokens (prefill token first)
    accepted: list[int]  # tokens committed by each verify step
    verified: list[int] = []  # tokens each verify step checked: the anchor and its drafts


def _as_ids(input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("the prompt is empty")
    return ids


def _first_stop(tokens: list[int], stop: set[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stop), None)


@torch.inference_mode()
def speculative_generate(
    target, proposer, input_ids, max_new_tokens: int, stop_token_ids=(), sampler=None
) -> SpecOutput:
    """Speculative decoding (see the module docstring): greedy, or sampled with ``sampler`` (a
    :class:`~dflash_staged.evaluate.sampling.Sampler` at a temperature > 0); ``proposer=None`` = no
    drafter."""
    sampled = sampler is not None and not sampler.greedy
    if proposer is not None and not hasattr(proposer, "propose"):
        proposer = DrafterProposer(proposer)
    stop = set(int(t) for t in stop_token_ids)
    B = proposer.block_size if proposer is not None else 1
    prompt = _as_ids(input_ids).to(target.device)
    P = prompt.numel()
    tokens = torch.empty(P + max_new_tokens + 1, dtype=torch.long, device=target.device)
    tokens[:P] = prompt
    logits, taps, cache = target.forward_with_taps(prompt[None])
    ctx = taps.new_empty(P + max_new_tokens + B, *taps.shape[2:])
    ctx[:P] = taps[0]
    tokens[P] = sampler.next_token(logits[0, -1]) if sampled else logits[0, -1].argmax()
    new, accepted, verified = [int(tokens[P])], [], []
    if proposer is not None:
        proposer.reset()
    s = P  # position of the anchor (the last committed token)
    if new[0] in stop:
        return SpecOutput(new, accepted, verified)
    sized = getattr(proposer, "sized", False)
    while len(new) < max_new_tokens:
        left = max_new_tokens - len(new)  # new tokens still to come
        size = min(B, left + 1)  # the verified block: the anchor and at most `left` drafts
        block = tokens[s : s + 1].clone()
        q = None
        kw = {"size": size} if sized and size < B else {}
        if size > 1 and sampled:
            drafts, q = proposer.propose(ctx[:s], tokens[: s + 1], sampler, **kw)
            drafts = drafts[: size - 1]
            q = proposal_rows(q, drafts.numel())
            block = torch.cat([block, drafts.to(block)])
        elif size > 1:
            drafts = proposer.propose(ctx[:s], tokens[: s + 1], **kw)[: size - 1]
            block = torch.cat([block, drafts.to(block)])
        size = block.numel()  # a proposer may draft fewer (DSpark's confidence schedule)
        verified.append(size)
        snapshot = copy.deepcopy(cache) if size > 1 and not target.supports_crop else None
        logits, vtaps, cache = target.forward_with_taps(block[None], cache)
        if sampled:
            a, last = sampler.verify(block[1:], q, logits[0])
        else:
            posterior = logits[0].argmax(-1)
            a = int((block[1:] == posterior[:-1]).long().cumprod(0).sum())
            last = int(posterior[a])
        commit = (block[1 : a + 1].tolist() + [last])[:left]  # a bonus past max_new_tokens is discarded
        end = _first_stop(commit, stop)
        commit = commit if end is None else commit[: end + 1]
        tokens[s + 1 : s + 1 + len(commit)] = torch.tensor(commit, device=tokens.device)
        new += commit
        accepted.append(len(commit))
        if end is not None:
            break
        keep = a + 1  # verified positions s..s+a enter the cache and the context
        ctx[s : s + keep] = vtaps[0, :keep]
        if target.supports_crop:
            from dflash_staged.model.target import crop_cache

            crop_cache(cache, s + keep)
        elif keep < size:
            _, _, cache = target.forward_with_taps(block[None, :keep], snapshot)
        s += keep
    return SpecOutput(new, accepted, verified)


@torch.inference_mode()
def greedy_generate(target, input_ids, max_new_tokens: int, stop_token_ids=(), sampler=None) -> list[int]:
    """Plain decoding with the KV cache, one token per forward: the new tokens. Greedy, or drawn
    from the target's distribution with ``sampler`` at a temperature > 0."""
    stop = set(int(t) for t in stop_token_ids)
    ids = _as_ids(input_ids).to(target.device)[None]
    logits, _, cache = target.forward_with_taps(ids)
    out: list[int] = []
    while True:
        nxt = logits[0, -1].argmax()
        if sampler is not None and not sampler.greedy:
            nxt = torch.tensor(sampler.next_token(logits[0, -1]), device=nxt.device)
        out.append(int(nxt))
        if len(out) >= max_new_tokens or out[-1] in stop:
            return out
        logits, _, cache = target.forward_with_taps(nxt.reshape(1, 1), cache)


def acceptance_stats(accepted: list[int], block_size: int) -> dict:
    """tau pooled over the steps (``tau`` and ``tau_pooled``), per-position acceptance rates (draft
    1..B-1) and the histogram of committed lengths 1..B."""
    n = len(accepted)
    hist = [0] * block_size
    for k in accepted:
        hist[k - 1] += 1
    rates = [sum(1 for k in accepted if k > j) / n if n else 0.0 for j in range(1, block_size)]
    tau = sum(accepted) / n if n else 0.0
    return {
        "tau": tau,
        "tau_pooled": tau,
        "steps": n,
        "per_position_acceptance": rates,
        "accept_length_histogram": hist,
    }
