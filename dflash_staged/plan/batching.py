"""Planning: length buckets, token-budget batches, and the per-epoch job order.

Contract (what :mod:`dflash_staged.manifest` stores and extract/train rely on):

* Buckets: ``edges`` are inclusive upper bounds; bucket b holds the samples with
  ``edges[b-1] < length <= edges[b]``. They are ``data.bucket_edges`` (with the
  longest length appended when the edges stop short of it; buckets may be
  empty), or, when that is empty, the length quantiles at k/num_buckets,
  k = 1..num_buckets (duplicates dropped, the last raised to the longest).
* Batches are formed once and are the same in every epoch. Within a bucket the
  samples are sorted by length, longest first (ties by sample id), and cut
  greedily: a batch starts at its longest sample L and takes
  ``token_budget // L`` samples, so ``batch_size * longest <= token_budget``.
  A batch never mixes buckets; its sample order (longest first) is fixed.
* Epoch e's job order is ``epoch_order(num_batches, seed, e)``, a permutation
  that is a pure function of (seed, e). Jobs run epoch-major, epochs numbered
  from 0; ``pos`` is the job's index within its epoch.
* Padding: padded tokens of a batch = batch_size * longest; the padding waste of
  a plan is ``1 - real / padded`` over one epoch (all epochs are identical).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from dflash_staged.config import Config, DataConfig
from dflash_staged.errors import DflashError


class PlanError(DflashError, ValueError):
    """The data cannot be planned under the config (e.g. a sample exceeds the token budget)."""


@dataclass
class PlannedJob:
    epoch: int
    pos: int
    bucket: int
    sample_ids: list[int]
    real_tokens: int
    padded_tokens: int


@dataclass
class Plan:
    """Batches (epoch-independent) plus how many epochs to run them in which order."""

    edges: list[int]
    epochs: int
    seed: int
    batches: list[tuple[int, list[int]]]  # (bucket, sample ids) per batch
    batch_real: np.ndarray = field(repr=False)  # int64 [B] real tokens per batch
    batch_padded: np.ndarray = field(repr=False)  # int64 [B] batch_size * longest per batch

    @property
    def tokens_real(self) -> int:
        """Real tokens in one epoch."""
        return int(self.batch_real.sum())

    @property
    def tokens_padded(self) -> int:
        """Padded tokens (sum of batch_size * longest) in one epoch."""
        return int(self.batch_padded.sum())

    @property
    def padding_waste(self) -> float:
        padded = self.tokens_padded
        return 1.0 - self.tokens_real / padded if padded else 0.0

    @property
    def num_jobs(self) -> int:
        return len(self.batches) * self.epochs

    def bucket_counts(self) -> list[int]:
        """Batches (= jobs per epoch) in each bucket."""
        counts = [0] * len(self.edges)
        for b, _ in self.batches:
            counts[b] += 1
        return counts

    def order(self, epoch: int) -> np.ndarray:
        return epoch_order(len(self.batches), self.seed, epoch)

    def jobs(self) -> Iterator[PlannedJob]:
        """All jobs of all epochs, epoch-major, in run order."""
        for epoch in range(self.epochs):
            for pos, b in enumerate(self.order(epoch).tolist()):
                bucket, ids = self.batches[b]
                yield PlannedJob(epoch, pos, bucket, ids, int(self.batch_real[b]), int(self.batch_padded[b]))


def bucket_edges(lengths: np.ndarray, data_cfg: DataConfig) -> list[int]:
    """Inclusive upper bounds of the length buckets: configured edges or automatic quantiles."""
    lengths = np.asarray(lengths)
    longest = int(lengths.max()) if len(lengths) else 1
    if data_cfg.bucket_edges:
        edges = [int(e) for e in data_cfg.bucket_edges]
        return edges if edges[-1] >= longest else edges + [longest]
    k = min(data_cfg.num_buckets, max(1, len(lengths)))  # more quantiles than samples only repeat edges
    qs = np.quantile(lengths, np.arange(1, k + 1) / k, method="inverted_cdf")
    edges = sorted(set(int(q) for q in qs))
    edges[-1] = longest
    return edges


def make_batches(
    lengths: np.ndarray, edges: list[int], token_budget: int
) -> tuple[list[tuple[int, list[int]]], np.ndarray, np.ndarray]:
    """Length-sorted greedy batches per bucket; returns (batches, real per batch, padded per batch).

    Each batch is ``(bucket, sample ids longest first)`` with ``len(ids) * longest <= token_budget``.
    Batches are ordered by bucket, then from the longest samples to the shortest.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return [], np.zeros(0, np.int64), np.zeros(0, np.int64)
    if lengths.min() < 1:
        raise PlanError("a sample has length 0; every sample needs at least one token")
    longest = int(lengths.max())
    if longest > token_budget:
        raise PlanError(
            f"a sample of {longest} tokens exceeds data.token_budget={token_budget}; "
            "raise the budget or lower data.max_len"
        )
    if longest > edges[-1]:
        raise PlanError(f"a sample of {longest} tokens is longer than the last bucket edge {edges[-1]}")
    bucket = np.searchsorted(np.asarray(edges), lengths, side="left")
    ids = np.arange(len(lengths), dtype=np.int64)
    order = np.lexsort((ids, -lengths, bucket))  # bucket asc, length desc, id asc
    slen, sbucket = lengths[order], bucket[order]
    bucket_end = np.searchsorted(sbucket, np.arange(len(edges)), side="right")
    per_longest = token_budget // slen  # batch size if a batch starts here
    starts = []
    i = 0
    for end in bucket_end.tolist():
        while i < end:
            starts.append(i)
            i = min(end, i + int(per_longest[i]))
    starts_a = np.asarray(starts, dtype=np.int64)
    sizes = np.diff(np.append(starts_a, len(order)))
    real = np.add.reduceat(slen, starts_a)
    padded = sizes * slen[starts_a]
    groups = np.split(order, starts_a[1:])
    buckets = sbucket[starts_a].tolist()
    batches = [(b, g.tolist()) for b, g in zip(buckets, groups)]
    return batches, real.astype(np.int64), padded.astype(np.int64)


def epoch_order(num_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The job order of `epoch`: a permutation of range(num_batches), a pure function of (seed, epoch)."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_batches)


def make_plan(lengths: np.ndarray, cfg: Config, epochs: int, seed: int) -> Plan:
    """Bucket, batch and order `lengths` (tokens per sample, after truncation) for `epochs` epochs."""
    if epochs < 1:
        raise PlanError(f"--epochs={epochs}: plan at least one epoch")
    if seed < 0:
        raise PlanError(f"--seed={seed}: use a non-negative seed")
    if len(lengths) == 0:
        raise PlanError("no samples to plan")
    edges = bucket_edges(lengths, cfg.data)
    batches, real, padded = make_batches(lengths, edges, cfg.data.token_budget)
    return Plan(edges=edges, epochs=epochs, seed=seed, batches=batches, batch_real=real, batch_padded=padded)


def random_batches_waste(lengths: np.ndarray, token_budget: int, seed: int = 0) -> float:
    """Baseline: padding waste of greedy token-budget batches over a random sample order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    shuffled = lengths[np.random.default_rng(seed).permutation(len(lengths))].tolist()
    padded = 0
    n = longest = 0
    for x in shuffled:
        m = x if x > longest else longest
        if (n + 1) * m > token_budget:
            padded += n * longest
            n, longest = 1, x
        else:
            n, longest = n + 1, m
    padded += n * longest
    return 1.0 - int(lengths.sum()) / padded
