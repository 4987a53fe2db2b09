"""Manifest benchmark: claim + publish cycles per second, SQLite against PostgreSQL, in one run.

    python bench/manifest_bench.py [--pg URL] [--seconds 4] [--workers 1,8,32] [--status-jobs 1000000]
                                   [--json OUT]

For 1, 8 and 32 concurrent worker processes (each its own manifest handle, looping claim then
publish, the window check included) it measures cycles per second on the SQLite manifest and on
the PostgreSQL one with its advisory window lock, and with row locks only (``FOR UPDATE SKIP
LOCKED``, ``PostgresManifest.CLAIM_LOCK = "skip_locked"``). Ratios are against SQLite at the
same number of workers, measured in the same run. Then the window under concurrent claims: in
each of 20 rounds all workers claim at once against a window of a quarter of them, and the most
claims any round granted is reported (more than the window is an overshoot). Last, the time of ``status``
(what
``dflash status --json`` computes) on a manifest of ``--status-jobs`` jobs, on both backends.

Without ``--pg`` it starts a throwaway PostgreSQL cluster (tests/pgcluster.py: Debian's
``postgresql`` binaries) with fsync on, as the SQLite manifest syncs every publish
(``synchronous=FULL``; claims commit without an fsync on both backends). Workers, the server
and this script share the machine's cores, so on a small machine the figures measure the
clients' CPU as much as the database.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
GOAL = 200.0  # claim + publish cycles per second at 32 workers on PostgreSQL (issue 13)


def fake_plan(n_jobs: int, per_job: int = 1, tokens: int = 8):
    """Samples and a one-epoch plan of ``n_jobs`` jobs, without tokenising anything."""
    n = n_jobs * per_job
    offsets = np.arange(n + 1, dtype=np.int64) * tokens
    samples = SimpleNamespace(
        tokens=(np.arange(offsets[-1]) % 2000 + 4).astype(np.int32),
        loss_mask=np.ones(offsets[-1], np.uint8),
        offsets=offsets,
        stats={"samples": n},
    )
    batches = [(0, list(range(b * per_job, (b + 1) * per_job))) for b in range(n_jobs)]

    def jobs():
        for pos, (bucket, ids) in enumerate(batches):
            yield SimpleNamespace(
                epoch=0,
                pos=pos,
                bucket=bucket,
                sample_ids=ids,
                real_tokens=tokens * per_job,
                padded_tokens=tokens * per_job,
            )

    plan = SimpleNamespace(
        edges=[tokens],
        epochs=1,
        seed=0,
        batches=batches,
        jobs=jobs,
        padding_waste=0.0,
        tokens_real=n * tokens,
        tokens_padded=n * tokens,
    )
    return samples, plan


def create(address, n_jobs: int):
    from dflash_staged.config import Config
    from dflash_staged.manifest import Manifest

    samples, plan = fake_plan(n_jobs)
    return Manifest.create(
        address, config=Config(), samples=samples, plan=plan, data_path="bench", data_hash="bench"
    )


def _open(address, lock: str):
    from dflash_staged.manifest import Manifest
    from dflash_staged.manifest.postgres import PostgresManifest

    PostgresManifest.CLAIM_LOCK = lock
    return Manifest.open(address)


def _cycler(address, lock, seconds, go, out):
    m = _open(address, lock)
    go.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        r = m.claim(f"b{os.getpid()}", window=10**9, lease_s=600)
        if r.job is None:
            break
        assert m.publish(r.job, 1, "bench")
        n += 1
    out.put((n, time.perf_counter() - t0))
    m.close()


def _claimer(address, lock, window, rounds, barrier, out):
    m = _open(address, lock)
    for _ in range(rounds):
        barrier.wait()  # everyone claims at once
        r = m.claim(f"c{os.getpid()}", window=window, lease_s=600)
        out.put(r.job is not None)
        barrier.wait()  # counted
        if r.job is not None:
            m.give_back(r.job, "bench round over")
        barrier.wait()  # the window is empty again
    m.close()


def cycles_per_s(address, lock: str, workers: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_cycler, args=(address, lock, seconds, go, out)) for _ in range(workers)]
    for p in procs:
        p.start()
    time.sleep(2.0 + 0.05 * workers)  # let every worker start and connect
    go.set()
    res = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return sum(n for n, _ in res) / max(t for _, t in res)


def most_claims(address, lock: str, workers: int, window: int, rounds: int = 20) -> int:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(workers + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_claimer, args=(address, lock, window, rounds, barrier, out))
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    most = 0
    for _ in range(rounds):
        barrier.wait()
        most = max(most, sum(out.get(timeout=120) for _ in procs))
        barrier.wait()
        barrier.wait()
    for p in procs:
        p.join(timeout=60)
    return most


def status_s(address, n_jobs: int) -> tuple[float, float]:
    """(create seconds, status seconds) of an ``n_jobs`` manifest; a few claims make the hosts view
    non-empty."""
    t0 = time.perf_counter()
    m = create(address, n_jobs)
    t_create = time.perf_counter() - t0
    for _ in range(8):
        m.claim("w", window=64)
    m.status()  # warm caches the way a second `dflash status` finds them
    t0 = time.perf_counter()
    st = m.status()
    t = time.perf_counter() - t0
    assert st["total_jobs"] == n_jobs
    m.close()
    return t_create, t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--pg", help="postgresql://USER@HOST:PORT/DB (a manifest name is added); default: a throwaway cluster"
    )
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--workers", default="1,8,32")
    ap.add_argument("--status-jobs", type=int, default=1_000_000)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cluster = None
    if args.pg:
        pg_base = args.pg.split("#")[0]
    else:
        from pgcluster import start_cluster

        cluster = start_cluster(durable=True)  # fsync on, like the SQLite manifest's synchronous=FULL
        pg_base = cluster.url("x").split("#")[0]
    tmp = Path(tempfile.mkdtemp(prefix="manifest-bench-"))
    stamp = f"{os.getpid()}_{int(time.time())}"
    results: dict = {
        "cpus": os.cpu_count(),
        "load_avg_before": os.getloadavg(),
        "seconds": args.seconds,
        "cycles_per_s": {},
        "most_claims": {},
        "status_s": {},
        "create_s": {},
    }
    try:
        workers = [int(w) for w in args.workers.split(",")]
        n_jobs = int(max(workers) * args.seconds * 600) + 1000  # enough for 600 cycles/s per worker
        print(
            f"manifest bench: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {n_jobs} jobs per "
            f"manifest; "
            "the machine is shared, figures are noisy",
            flush=True,
        )
        for w in workers:
            row = {}
            for label, lock in (
                ("sqlite", "advisory"),
                ("postgres", "advisory"),
                ("postgres_skip_locked", "skip_locked"),
            ):
                addr = tmp / f"lite-{w}" if label == "sqlite" else f"{pg_base}#b_{label}_{w}_{stamp}"
                create(addr, n_jobs).close()
                row[label] = round(cycles_per_s(addr, lock, w, args.seconds), 1)
            results["cycles_per_s"][w] = row
            base = row["sqlite"]
            print(
                f"  {w:>2} workers: sqlite {base:8.1f}/s | postgres {row['postgres']:8.1f}/s "
                f"({row['postgres'] / base:.2f}x sqlite) | postgres skip-locked only "
                f"{row['postgres_skip_locked']:8.1f}"
                f"/s ({row['postgres_skip_locked'] / base:.2f}x)",
                flush=True,
            )
        w = max(workers)
        win = max(1, w // 4)
        results["overshoot_window"] = win
        for label, lock in (("postgres", "advisory"), ("postgres_skip_locked", "skip_locked")):
            addr = f"{pg_base}#o_{label}_{stamp}"
            create(addr, 10_000).close()
            results["most_claims"][label] = most_claims(addr, lock, w, win)
        print(
            f"  window {win}, {w} workers claiming at once (20 rounds): most granted in a round: advisory "
            f"lock {results['most_claims']['postgres']}, skip-locked only "
            f"{results['most_claims']['postgres_skip_locked']}"
            f" (more than {win} overshoots the window)",
            flush=True,
        )
        for label, addr in (("sqlite", tmp / "status"), ("postgres", f"{pg_base}#s_{stamp}")):
            results["create_s"][label], results["status_s"][label] = (
                round(x, 3) for x in status_s(addr, args.status_jobs)
            )
        print(
            f"  status on {args.status_jobs:,} jobs: sqlite {results['status_s']['sqlite']:.3f} s | postgres "
            f"{results['status_s']['postgres']:.3f} s "
            f"({results['status_s']['postgres'] / results['status_s']['sqlite']:.2f}x)"
            f"; plan (create) sqlite {results['create_s']['sqlite']:.1f} s, postgres "
            f"{results['create_s']['postgres']:.1f} s",
            flush=True,
        )
        pg32 = results["cycles_per_s"].get(32, {}).get("postgres")
        if pg32 is not None:
            print(
                f"  goal: >= {GOAL:.0f} cycles/s at 32 workers on PostgreSQL: {pg32:.0f}/s "
                f"({'met' if pg32 >= GOAL else 'NOT met'})",
                flush=True,
            )
        results["load_avg_after"] = os.getloadavg()
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        if cluster is not None:
            cluster.destroy()


if __name__ == "__main__":
    main()
