"""Planning speed and padding waste on 1,000,000 synthetic samples.

    python bench/plan_bench.py [--samples 1000000] [--epochs 1] [--max-len 4096] [--budget 16384] [--json]

Lengths are long-tailed like chat data: log-normal (median ~545 tokens, sigma 0.9),
at least 16 tokens, truncated at ``--max-len`` (so a few percent pile up there).
Timed end to end: drawing the lengths, ``make_plan`` (quantile buckets, length-sorted
token-budget batches) and materialising every job of every epoch (``Plan.jobs()``,
what ``Manifest.create`` consumes). The baseline is random batching at the same
budget: the samples in a random order, cut greedily under ``batch_size * longest
<= budget``. Reported: seconds, padding waste of both, and the ratio.
With ``--json`` the last line is a JSON object with all results.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dflash_staged.config import Config, DataConfig
from dflash_staged.plan.batching import make_plan, random_batches_waste


def synthetic_lengths(n: int, max_len: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(545), 0.9, n), 16, max_len).astype(np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    cfg = Config(data=DataConfig(max_len=a.max_len, token_budget=a.budget, num_buckets=a.buckets))
    t0 = time.perf_counter()
    lengths = synthetic_lengths(a.samples, a.max_len, a.seed)
    t1 = time.perf_counter()
    plan = make_plan(lengths, cfg, a.epochs, a.seed)
    t2 = time.perf_counter()
    n_jobs = sum(1 for _ in plan.jobs())
    t3 = time.perf_counter()
    baseline = random_batches_waste(lengths, a.budget, a.seed)
    t4 = time.perf_counter()

    res = {
        "samples": a.samples,
        "epochs": a.epochs,
        "max_len": a.max_len,
        "token_budget": a.budget,
        "mean_len": float(lengths.mean()),
        "median_len": float(np.median(lengths)),
        "truncated_frac": float((lengths == a.max_len).mean()),
        "bucket_edges": plan.edges,
        "jobs": n_jobs,
        "jobs_per_epoch": len(plan.batches),
        "seconds_total": t3 - t0,
        "seconds_lengths": t1 - t0,
        "seconds_make_plan": t2 - t1,
        "seconds_jobs": t3 - t2,
        "seconds_baseline": t4 - t3,
        "padding_waste": plan.padding_waste,
        "padding_waste_random": baseline,
        "waste_ratio_random_over_planned": baseline / plan.padding_waste
        if plan.padding_waste
        else float("inf"),
    }
    print(
        f"planned {a.samples:,} samples x {a.epochs} epoch(s) into {n_jobs:,} jobs in "
        f"{res['seconds_total']:.2f} s "
        f"(lengths {res['seconds_lengths']:.2f} s, make_plan {res['seconds_make_plan']:.2f} s, "
        f"jobs {res['seconds_jobs']:.2f} s)"
    )
    print(
        f"lengths: mean {res['mean_len']:.0f}, median {res['median_len']:.0f}, "
        f"{res['truncated_frac']:.1%} at max_len {a.max_len}; buckets <= {plan.edges}"
    )
    print(
        f"padding waste: planned {plan.padding_waste:.4%}, random batching {baseline:.2%} "
        f"(same budget {a.budget}; {res['waste_ratio_random_over_planned']:.0f}x more)"
    )
    if a.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
