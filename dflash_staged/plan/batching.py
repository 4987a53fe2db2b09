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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

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


def make_batches(lengths: np.ndarray, edges: list[int], token_budget: int
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
        raise PlanError(f"a sample of {longest} tokens exceeds data.token_budget={token_budget}; "
                        "raise the budget or lower data.max_len")
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


# --- the `dflash plan` / `dflash status` commands ------------------------------------------

def plan_manifest(config_path: str | Path, data_path: str | Path, manifest_dir: str | Path | None = None, *,
                  epochs: int = 1, seed: int = 0, skip_bad: bool = False, progress: bool = False) -> str:
    """Ingest, plan and create the manifest (a no-op if it exists with the same inputs); return a summary.

    Everything is computed in memory first, so a failing ingestion writes nothing.
    """
    from dflash_staged.config import ConfigError, load_config
    from dflash_staged.plan.dataset import load_dataset, target_text_config, target_vocab_size
    from dflash_staged.manifest import Manifest
    from dflash_staged.model.target import resolve_layer_ids

    cfg = load_config(config_path)
    manifest_dir = Path(manifest_dir) if manifest_dir else Path("manifests") / Path(config_path).stem
    layer_ids = resolve_layer_ids(cfg.target, target_text_config(cfg.target).num_hidden_layers,
                                  cfg.drafter.num_hidden_layers)
    vocab, mask_id = target_vocab_size(cfg.target), cfg.drafter.mask_token_id
    if mask_id != -1 and not 0 <= mask_id < vocab:
        raise ConfigError(f"{config_path}: drafter.mask_token_id={mask_id} is outside the target vocabulary "
                          f"0..{vocab - 1}; use -1 (= len(tokenizer)) or an unused or special id below {vocab}")
    samples, data_hash = load_dataset(data_path, cfg, skip_bad=skip_bad, progress=progress)
    plan = make_plan(samples.lengths(), cfg, epochs, seed)
    existed = (manifest_dir / "manifest.db").exists()
    with Manifest.create(manifest_dir, config=cfg, samples=samples, plan=plan,
                         data_path=str(Path(data_path).resolve()), data_hash=data_hash, layer_ids=layer_ids):
        pass
    head = (f"{manifest_dir} already holds this plan (same config, data, epochs and seed); nothing to do"
            if existed else f"planned {manifest_dir}")
    return head + "\n" + format_plan_summary(samples, plan, str(data_path), cfg.data.max_len,
                                              cfg.min_loss_tokens, layer_ids)


def format_plan_summary(samples, plan: Plan, data_path: str, max_len: int, min_loss: int,
                        layer_ids: list[int] | None = None) -> str:
    st = samples.stats
    lines = [f"  samples: {st['samples']:,} from {data_path} ({st['lines']:,} lines)"]
    skipped = [f"{st['bad']:,} bad"] if st.get("bad") else []
    if st.get("skipped_long"):
        skipped.append(f"{st['skipped_long']:,} longer than max_len {max_len}")
    if st.get("skipped_short_loss"):
        skipped.append(f"{st['skipped_short_loss']:,} with < {min_loss} loss tokens")
    lines.append(f"  skipped: {', '.join(skipped) or 'none'}"
                 + (f"; truncated to {max_len}: {st['truncated']:,}" if st.get("truncated") else ""))
    for ex in getattr(samples, "bad_examples", [])[:3]:
        lines.append(f"    e.g. {ex}")
    lows = [1] + [e + 1 for e in plan.edges[:-1]]
    buckets = [f"{a}-{b}: {n}" for a, b, n in zip(lows, plan.edges, plan.bucket_counts())]
    lines.append(f"  buckets (length range: jobs per epoch): {', '.join(buckets)}")
    lines.append(f"  jobs: {len(plan.batches):,} per epoch x {plan.epochs} epoch(s) = {plan.num_jobs:,}; "
                 f"seed {plan.seed}")
    lines.append(f"  tokens per epoch: {plan.tokens_real:,} real, {plan.tokens_padded:,} padded; "
                 f"padding waste {plan.padding_waste:.2%}")
    if layer_ids is not None:
        lines.append(f"  tapped target layers: {layer_ids}")
    return "\n".join(lines)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def format_status(st: dict) -> str:
    """Human form of ``Manifest.status()``: a table of job states and a progress line."""
    jobs, total = st["jobs"], max(1, sum(st["jobs"].values()))
    rows = [f"{'state':<10}{'jobs':>10}{'share':>9}"]
    rows += [f"{k:<10}{n:>10,}{n / total:>9.1%}" for k, n in jobs.items()]
    extracted = sum(jobs[k] for k in ("written", "consumed", "released", "kept"))
    trained = sum(jobs[k] for k in ("consumed", "released", "kept"))
    win = st["window"]
    rows.append(f"extracted {extracted:,}/{total:,} ({extracted / total:.1%}), trained {trained:,}/{total:,} "
                f"({trained / total:.1%}) over {st['epochs']} epoch(s); window {win['shards']} shards "
                f"{_human_bytes(win['bytes'])}; extract {'done' if st['extract_done'] else 'running'}; "
                f"padding waste {st['padding_waste']:.2%}")
    return "\n".join(rows)
