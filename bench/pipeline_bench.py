"""Disk-staged pipeline vs the old in-memory queue handoff, with a synthetic target, in three regimes.

A synthetic target produces hidden states [T, K, H] (bf16) at a chosen token rate;
a synthetic trainer consumes them at another rate (its "step" is a sleep of
tokens / rate). Three regimes (``--regimes``), from the slower side's rate ``--rate`` and
``--factor``: extraction faster (target ``rate x factor``, trainer ``rate``), balanced (both
``rate``), training faster (target ``rate``, trainer ``rate x factor``). Both designs move the
same tensors:

* staged: producer *processes* claim jobs from a real manifest (window-bounded),
  write shards with the real store (fsync + atomic publish under the claim), and
  the trainer tails the manifest through the real LiveSource + ShardBuffer (read
  with XXH3-64 verification), waits as ``dflash train`` waits (polls backing off, releasing
  early only on a full window), marks shards consumed, and releases them every
  `--ckpt-every` steps;
* queue: a producer thread hands tensors to the trainer thread through an
  unbounded ``queue.Queue`` (the old design).

Reported per regime, scale and design: end-to-end samples/s, both sides' idle shares
(:mod:`dflash_staged.manifest.balance`: the producers' time on a full window, which the unbounded
queue never has, and the trainer's data wait), peak store bytes (staged) and peak trainer RSS, at
each ``--scales`` multiple of ``--jobs``; then per regime the staged/queue throughput ratio and the
bottleneck the staged run's figures name (what ``dflash status`` would say).

    .venv/bin/python bench/pipeline_bench.py [--jobs 24] [--scales 1] [--regimes balanced] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_staged.config import Config  # noqa: E402
from dflash_staged.manifest import Manifest  # noqa: E402
from dflash_staged.manifest.balance import SIDES, shares, verdict  # noqa: E402
from dflash_staged.store import Remover, ShardStore, StoreMeta  # noqa: E402
from dflash_staged.train.buffer import ShardBuffer, bound_host_memory  # noqa: E402
from dflash_staged.train.draw import CHECKPOINT_AFTER_S, wait_pauses  # noqa: E402
from dflash_staged.train.sources import LiveSource  # noqa: E402


def make_manifest(root: Path, jobs: int, tokens_per_job: int, samples_per_job: int = 4) -> Manifest:
    n = jobs * samples_per_job
    per = tokens_per_job // samples_per_job
    offsets = np.arange(n + 1, dtype=np.int64) * per
    samples = SimpleNamespace(
        tokens=(np.arange(offsets[-1]) % 2000 + 4).astype(np.int32),
        loss_mask=np.ones(offsets[-1], np.uint8),
        offsets=offsets,
        stats={"samples": n},
    )
    batches = [(b % 4, list(range(b * samples_per_job, (b + 1) * samples_per_job))) for b in range(jobs)]

    def job_iter():
        for pos, (bucket, ids) in enumerate(batches):
            yield SimpleNamespace(
                epoch=0,
                pos=pos,
                bucket=bucket,
                sample_ids=ids,
                real_tokens=per * len(ids),
                padded_tokens=per * len(ids),
            )

    plan = SimpleNamespace(
        edges=[1, 2, 3, 4],
        epochs=1,
        seed=0,
        batches=batches,
        jobs=job_iter,
        padding_waste=0.0,
        tokens_real=n * per,
        tokens_padded=n * per,
    )
    return Manifest.create(
        root / "manifest",
        config=Config(),
        samples=samples,
        plan=plan,
        data_path="synthetic",
        data_hash=f"synthetic-{jobs}",
    )


def synthetic_hidden(tokens: int, K: int, H: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(tokens)
    return torch.randn(tokens, K, H, generator=g).to(torch.bfloat16)


def producer_proc(
    mdir: str, sdir: str, rate: float, window: int, K: int, H: int, idx: int, out, ready
) -> None:
    """One producer; starts with the others (``ready``: a barrier), and puts its seconds busy / on a
    full window / with nothing to claim on ``out`` at the end, counted as an extract worker counts
    them (from its first claim, each pass by what its claim got). As a worker does, it runs the
    target (here: sleeps T / rate) and hands the shard to a writer thread, which stages and
    publishes it while the next job runs (one shard waits at most)."""
    torch.set_num_threads(1)
    m = Manifest.open(mdir)
    writer_m = Manifest.open(mdir)  # the writer thread's own handle, as the worker's Publisher has
    store = ShardStore.open(sdir)
    writer = ThreadPoolExecutor(1)
    pending = None
    ready.wait()
    cache: dict[int, torch.Tensor] = {}
    seconds = dict.fromkeys(SIDES["extract"], 0.0)
    kind, mark = None, time.perf_counter()

    def write(job, hidden: torch.Tensor) -> None:
        T = job.real_tokens
        staged = store.stage_shard(
            0,
            job.id,
            hidden,
            torch.arange(T, dtype=torch.int32),
            torch.ones(T, dtype=torch.uint8),
            torch.tensor([0, T], dtype=torch.int64),
            torch.tensor([job.id], dtype=torch.int64),
        )
        commit = lambda s=staged: store.commit_staged(s)  # noqa: E731
        if not writer_m.publish(job, staged.info.nbytes, staged.info.checksum, commit=commit):
            store.discard_staged(staged)

    while True:
        now = time.perf_counter()
        if kind is not None:
            seconds[kind] += now - mark
        mark = now
        r = m.claim(f"p{idx}", window=window, lease_s=600)
        if r.job is None:
            kind = "window_full_s" if r.window_full else "no_work_s"
            if r.nothing_left:
                if pending is not None:
                    pending.result()
                out.put(seconds)
                return
            time.sleep(0.005)
            continue
        kind = "busy_s"
        T = r.job.real_tokens
        if T not in cache:  # made once per length: the "forward" below is the sleep
            cache[T] = synthetic_hidden(T, K, H)
        hidden = cache[T]
        time.sleep(T / rate)  # the target's forward
        if pending is not None:
            pending.result()  # the previous shard is published before this one is handed over
        pending = writer.submit(write, r.job, hidden)


class RssSampler(threading.Thread):
    def __init__(self, store_root: Path | None = None):
        super().__init__(daemon=True)
        self.proc = psutil.Process()
        self.store_root = store_root
        self.peak_rss = 0
        self.peak_disk = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
            if self.store_root is not None and self.store_root.exists():
                self.peak_disk = max(self.peak_disk, disk_bytes(self.store_root))


def disk_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


def run_staged(jobs: int, a) -> dict:
    root = Path(tempfile.mkdtemp(prefix="dflash-pbench-", dir=a.dir))
    try:
        m = make_manifest(root, jobs, a.tokens_per_job)
        meta = StoreMeta(
            manifest_id=m.manifest_id,
            target_id="synthetic",
            layer_ids=list(range(a.K)),
            hidden_size=a.H,
            logical_dtype="bfloat16",
        )
        store = ShardStore.create_or_open(root / "store", meta)
        sampler = RssSampler(root / "store")
        sampler.start()
        ctx = mp.get_context("spawn")
        out, ready = ctx.Queue(), ctx.Barrier(a.producers)
        procs = [
            ctx.Process(
                target=producer_proc,
                args=(
                    str(m.dir),
                    str(store.root),
                    a.producer_tok_s / a.producers,
                    a.window,
                    a.K,
                    a.H,
                    i,
                    out,
                    ready,
                ),
            )
            for i in range(a.producers)
        ]
        for p in procs:
            p.start()
        source = LiveSource(m, store, "bench", 0)
        buf = ShardBuffer(store, a.capacity)
        gen = torch.Generator().manual_seed(0)
        step = wait = 0.0
        over = {"consume_s": 0.0, "release_s": 0.0, "fill_s": 0.0}
        done_samples, steps, consumed_since = 0, 0, []
        t_start = None
        while True:
            tw, scheduled, pauses = time.perf_counter(), 0.0, wait_pauses()
            while True:  # waiting as dflash train waits (train.draw)
                tf = time.perf_counter()
                source.fill(buf)
                over["fill_s"] += time.perf_counter() - tf
                if len(buf) >= a.min_ready or source.finished():
                    break
                if consumed_since and (scheduled >= CHECKPOINT_AFTER_S or m.window()["shards"] >= a.window):
                    release(m, store, consumed_since)  # never wait on a full window holding consumed shards
                pause = next(pauses)
                scheduled += pause
                time.sleep(pause)
            if t_start is None:
                t_start = time.perf_counter()  # producers' process start-up is not part of the rate
            else:
                wait += time.perf_counter() - tw
            if not len(buf):
                break
            picked, buckets = [], set()
            while len(picked) < a.grad_accum and len(buf):
                e = buf.draw(buckets, gen, prefer_read=True)  # as the live trainer draws
                shard, w = buf.load(e)
                wait += w
                buckets.add(e.bucket)
                picked.append((e.job, shard))
            tokens = sum(int(s.input_ids.numel()) for _, s in picked)
            ts = time.perf_counter()
            time.sleep(tokens / a.consumer_tok_s)  # the drafter's step
            step += time.perf_counter() - ts
            steps += 1
            tc = time.perf_counter()
            m.consume([j.id for j, _ in picked], steps)
            over["consume_s"] += time.perf_counter() - tc
            consumed_since += [j.id for j, _ in picked]
            done_samples += len(picked)
            if steps % a.ckpt_every == 0:
                tr = time.perf_counter()
                release(m, store, consumed_since)
                over["release_s"] += time.perf_counter() - tr
        release(m, store, consumed_since)
        REMOVER.wait()
        wall = time.perf_counter() - t_start
        produced = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join()
        sampler.stop.set()
        buf.close()
        assert m.counts()["released"] == jobs, m.counts()
        extract_s = {k: sum(p[k] for p in produced) for k in SIDES["extract"]}
        train_s = {"busy_s": wall - wait, "data_wait_s": wait}
        v = verdict(extract_s, train_s, a.producers, 1, unit="devices")
        return {
            "samples_per_s": done_samples / wall,
            "data_wait_frac": wait / wall,
            "producer_full_frac": shares(extract_s)["window_full_s"],
            "producer_seconds": extract_s,
            "bottleneck": v["bottleneck"],
            "verdict": v["text"],
            "wall_s": wall,
            "trainer_ms_per_step": {k: round(1000 * v / max(1, steps), 2) for k, v in over.items()},
            "peak_store_bytes": sampler.peak_disk,
            "peak_rss_bytes": sampler.peak_rss,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


REMOVER = Remover()


def release(m: Manifest, store: ShardStore, ids: list[int]) -> None:
    store.delete_shards([(0, i) for i in ids], REMOVER)  # as the trainer's ledger releases
    m.release(ids)
    ids.clear()


def run_queue(jobs: int, a) -> dict:
    q: queue.Queue = queue.Queue()  # unbounded: the old design
    sampler = RssSampler()
    sampler.start()
    cache: dict[int, torch.Tensor] = {}

    def producer():
        for j in range(jobs):
            t0 = time.perf_counter()
            T = a.tokens_per_job
            if T not in cache:
                cache[T] = synthetic_hidden(T, a.K, a.H)
            h = cache[T].clone()  # a fresh tensor per job, as a target makes
            time.sleep(max(0.0, T / a.producer_tok_s - (time.perf_counter() - t0)))
            q.put((j % 4, h))
        q.put(None)

    th = threading.Thread(target=producer, daemon=True)
    t_start = time.perf_counter()
    th.start()
    wait, done, finished = 0.0, 0, False
    first = True
    while not finished:
        picked = []
        while len(picked) < a.grad_accum:
            tw = time.perf_counter()
            item = q.get()
            if first:
                t_start, first = time.perf_counter(), False
            else:
                wait += time.perf_counter() - tw
            if item is None:
                finished = True
                break
            picked.append(item)
        if picked:
            time.sleep(sum(h.shape[0] for _, h in picked) / a.consumer_tok_s)
            done += len(picked)
    wall = time.perf_counter() - t_start
    sampler.stop.set()
    return {
        "samples_per_s": done / wall,
        "data_wait_frac": wait / wall,
        "producer_full_frac": 0.0,  # an unbounded queue never makes the producer wait
        "wall_s": wall,
        "peak_rss_bytes": sampler.peak_rss,
    }


REGIMES = {  # (target, trainer) rates in units of --rate; the other side is --factor times faster
    "extract_faster": lambda f: (f, 1.0),
    "balanced": lambda f: (1.0, 1.0),
    "train_faster": lambda f: (1.0, f),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=30, help="jobs at 1x (10x runs 10 times as many)")
    p.add_argument("--tokens-per-job", type=int, default=2048)
    p.add_argument("--K", type=int, default=5)
    p.add_argument("--H", type=int, default=512)
    p.add_argument("--rate", type=float, default=20_000, help="the slower side's tokens/s (all producers)")
    p.add_argument("--factor", type=float, default=2.0, help="how much faster the faster side is")
    p.add_argument("--regimes", default=",".join(REGIMES), help=f"any of {', '.join(REGIMES)}")
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--capacity", type=int, default=4)
    p.add_argument("--min-ready", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--scales", default="1,10")
    p.add_argument("--dir", default=None, help="where the staged store goes (default: the temp dir)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    regimes = [r.strip() for r in a.regimes.split(",") if r.strip()]
    bad = [r for r in regimes if r not in REGIMES]
    if bad:
        p.error(f"--regimes: unknown {', '.join(bad)}; use any of {', '.join(REGIMES)}")
    scales = [int(s) for s in a.scales.split(",")]
    torch.set_num_threads(1)
    bound_host_memory()  # as dflash train does; applies to both designs
    res: dict = {"settings": {k: v for k, v in vars(a).items() if k != "json"}}
    mb = a.tokens_per_job * a.K * a.H * 2 / 2**20
    print(f"shard {mb:.1f} MiB; {a.producers} producers, window {a.window}")
    print(
        f"{'regime':>14} {'scale':>5} {'design':>7} {'samples/s':>10} {'prod idle':>9} {'wait %':>7} "
        f"{'peak store':>11} {'peak RSS':>9} {'wall s':>7}"
    )
    for regime in regimes:
        prod, cons = REGIMES[regime](a.factor)
        a.producer_tok_s, a.consumer_tok_s = prod * a.rate, cons * a.rate
        for scale in scales:
            for name, fn in (("queue", run_queue), ("staged", run_staged)):
                r = fn(a.jobs * scale, a)
                res[f"{regime}/{name}_x{scale}"] = r
                print(
                    f"{regime:>14} {scale:>5} {name:>7} {r['samples_per_s']:>10.2f} "
                    f"{100 * r['producer_full_frac']:>8.2f}% {100 * r['data_wait_frac']:>6.2f}% "
                    f"{r.get('peak_store_bytes', 0) / 2**20:>9.1f}Mi {r['peak_rss_bytes'] / 2**20:>7.0f}Mi "
                    f"{r['wall_s']:>7.2f}"
                    + "".join(f" {k[:-2]} {v} ms" for k, v in r.get("trainer_ms_per_step", {}).items())
                )
        res[regime] = summarize(res, regime, scales, a)
    for regime in regimes:
        x = res[regime]
        print(
            f"{regime}: target {x['target_tok_s']:,.0f} tok/s, trainer {x['trainer_tok_s']:,.0f} tok/s | "
            f"staged/queue throughput {x['throughput_ratio_vs_queue']} | staged x{scales[-1]}: producers "
            f"idle {100 * x['producer_full_frac']:.2f}% on a full window, trainer data wait "
            f"{100 * x['data_wait_frac']:.2f}% | growth x{scales[-1]}: disk {x['staged_disk_growth']:.2f}x, "
            f"staged RSS {x['staged_rss_growth']:.2f}x, queue RSS {x['queue_rss_growth']:.2f}x\n"
            f"  bottleneck: {x['verdict']}"
        )
    if a.json:
        print(json.dumps(res))


def summarize(res: dict, regime: str, scales: list[int], a) -> dict:
    """One regime's figures: the ratio per scale, the largest scale's idle shares and verdict, growth."""
    first, last = scales[0], scales[-1]
    staged, queue_ = res[f"{regime}/staged_x{last}"], res[f"{regime}/queue_x{last}"]
    return {
        "target_tok_s": a.producer_tok_s,
        "trainer_tok_s": a.consumer_tok_s,
        "throughput_ratio_vs_queue": {
            f"x{s}": round(
                res[f"{regime}/staged_x{s}"]["samples_per_s"] / res[f"{regime}/queue_x{s}"]["samples_per_s"],
                4,
            )
            for s in scales
        },
        "producer_full_frac": staged["producer_full_frac"],
        "data_wait_frac": staged["data_wait_frac"],
        "queue_data_wait_frac": queue_["data_wait_frac"],
        "bottleneck": staged["bottleneck"],
        "verdict": staged["verdict"],
        "staged_disk_growth": staged["peak_store_bytes"]
        / max(1, res[f"{regime}/staged_x{first}"]["peak_store_bytes"]),
        "staged_rss_growth": staged["peak_rss_bytes"]
        / max(1, res[f"{regime}/staged_x{first}"]["peak_rss_bytes"]),
        "queue_rss_growth": queue_["peak_rss_bytes"]
        / max(1, res[f"{regime}/queue_x{first}"]["peak_rss_bytes"]),
    }


if __name__ == "__main__":
    main()
