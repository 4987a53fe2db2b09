"""Disk-staged pipeline vs the old in-memory queue handoff, with a synthetic target.

A synthetic target produces hidden states [T, K, H] (bf16) at a chosen token rate;
a synthetic trainer consumes them at another rate (its "step" is a sleep of
tokens / rate). Both designs move the same tensors:

* staged: producer *processes* claim jobs from a real manifest (window-bounded),
  write shards with the real store (fsync + atomic publish under the claim), and
  the trainer tails the manifest through the real LiveSource + ShardBuffer (read
  with XXH3-64 verification), marks shards consumed, and releases them every
  `--ckpt-every` steps, exactly as `dflash train` does;
* queue: a producer thread hands tensors to the trainer thread through an
  unbounded ``queue.Queue`` (the old design).

Reported per design: end-to-end samples/s, the trainer's data-wait share, peak
store bytes (staged) and peak trainer RSS, at 1x and 10x the dataset size.

    .venv/bin/python bench/pipeline_bench.py [--jobs 24] [--json]
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
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_staged.config import Config  # noqa: E402
from dflash_staged.manifest import Manifest  # noqa: E402
from dflash_staged.store import ShardStore, StoreMeta  # noqa: E402
from dflash_staged.train.buffer import ShardBuffer, bound_host_memory  # noqa: E402
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


def producer_proc(mdir: str, sdir: str, rate: float, window: int, K: int, H: int, idx: int) -> None:
    torch.set_num_threads(1)
    m = Manifest.open(mdir)
    store = ShardStore.open(sdir)
    cache: dict[int, torch.Tensor] = {}
    while True:
        r = m.claim(f"p{idx}", window=window, lease_s=600)
        if r.job is None:
            if r.nothing_left:
                return
            time.sleep(0.005)
            continue
        t0 = time.perf_counter()
        T = r.job.real_tokens
        hidden = cache.setdefault(T, synthetic_hidden(T, K, H))
        ids = torch.arange(T, dtype=torch.int32)
        cu = torch.tensor([0, T], dtype=torch.int64)
        staged = store.stage_shard(
            0,
            r.job.id,
            hidden,
            ids,
            torch.ones(T, dtype=torch.uint8),
            cu,
            torch.tensor([r.job.id], dtype=torch.int64),
        )
        # pace: the target needs T / rate seconds per job; the write overlaps that compute time
        time.sleep(max(0.0, T / rate - (time.perf_counter() - t0)))
        if not m.publish(
            r.job, staged.info.nbytes, staged.info.checksum, commit=lambda s=staged: store.commit_staged(s)
        ):
            store.discard_staged(staged)


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
        procs = [
            ctx.Process(
                target=producer_proc,
                args=(str(m.dir), str(store.root), a.producer_tok_s / a.producers, a.window, a.K, a.H, i),
            )
            for i in range(a.producers)
        ]
        for p in procs:
            p.start()
        source = LiveSource(m, store, "bench", 0)
        buf = ShardBuffer(store, a.capacity)
        gen = torch.Generator().manual_seed(0)
        step = wait = 0.0
        done_samples, steps, consumed_since = 0, 0, []
        t_start = None
        while True:
            tw = time.perf_counter()
            while True:
                source.fill(buf)
                if len(buf) >= a.min_ready or source.finished():
                    break
                if consumed_since:  # never wait while holding consumed, unreleased shards
                    release(m, store, consumed_since)
                time.sleep(0.002)
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
            m.consume([j.id for j, _ in picked], steps)
            consumed_since += [j.id for j, _ in picked]
            done_samples += len(picked)
            if steps % a.ckpt_every == 0:
                release(m, store, consumed_since)
        release(m, store, consumed_since)
        wall = time.perf_counter() - t_start
        for p in procs:
            p.join()
        sampler.stop.set()
        buf.close()
        assert m.counts()["released"] == jobs, m.counts()
        return {
            "samples_per_s": done_samples / wall,
            "data_wait_frac": wait / wall,
            "wall_s": wall,
            "peak_store_bytes": sampler.peak_disk,
            "peak_rss_bytes": sampler.peak_rss,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def release(m: Manifest, store: ShardStore, ids: list[int]) -> None:
    for i in ids:
        store.delete_shard(0, i)
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
            h = cache.setdefault(
                T, synthetic_hidden(T, a.K, a.H)
            ).clone()  # a fresh tensor per job, as a target makes
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
        "wall_s": wall,
        "peak_rss_bytes": sampler.peak_rss,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=30, help="jobs at 1x (10x runs 10 times as many)")
    p.add_argument("--tokens-per-job", type=int, default=2048)
    p.add_argument("--K", type=int, default=5)
    p.add_argument("--H", type=int, default=512)
    p.add_argument(
        "--producer-tok-s", type=float, default=40_000, help="synthetic target rate (all producers)"
    )
    p.add_argument("--consumer-tok-s", type=float, default=20_000, help="synthetic trainer rate")
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
    torch.set_num_threads(1)
    bound_host_memory()  # as dflash train does; applies to both designs
    res: dict = {"settings": {k: v for k, v in vars(a).items() if k != "json"}}
    mb = a.tokens_per_job * a.K * a.H * 2 / 2**20
    print(
        f"shard {mb:.1f} MiB; producer {a.producer_tok_s:,.0f} tok/s > consumer {a.consumer_tok_s:,.0f} tok/s"
    )
    print(
        f"{'scale':>5} {'design':>7} {'samples/s':>10} {'wait %':>7} {'peak store':>11} {'peak RSS':>9} "
        f"{'wall s':>7}"
    )
    for scale in [int(s) for s in a.scales.split(",")]:
        jobs = a.jobs * scale
        for name, fn in (("queue", run_queue), ("staged", run_staged)):
            r = fn(jobs, a)
            res[f"{name}_x{scale}"] = r
            print(
                f"{scale:>5} {name:>7} {r['samples_per_s']:>10.2f} {100 * r['data_wait_frac']:>6.2f}% "
                f"{r.get('peak_store_bytes', 0) / 2**20:>9.1f}Mi {r['peak_rss_bytes'] / 2**20:>7.0f}Mi "
                f"{r['wall_s']:>7.2f}"
            )
    s1 = res["staged_x1"]
    res["throughput_ratio_vs_queue"] = {
        f"x{s}": res[f"staged_x{s}"]["samples_per_s"] / res[f"queue_x{s}"]["samples_per_s"]
        for s in [int(x) for x in a.scales.split(",")]
    }
    last = int(a.scales.split(",")[-1])
    res["staged_disk_growth"] = res[f"staged_x{last}"]["peak_store_bytes"] / max(1, s1["peak_store_bytes"])
    res["staged_rss_growth"] = res[f"staged_x{last}"]["peak_rss_bytes"] / max(1, s1["peak_rss_bytes"])
    res["queue_rss_growth"] = res[f"queue_x{last}"]["peak_rss_bytes"] / max(
        1, res["queue_x1"]["peak_rss_bytes"]
    )
    print(
        f"staged/queue throughput: {res['throughput_ratio_vs_queue']}; staged data-wait "
        f"{100 * res[f'staged_x{last}']['data_wait_frac']:.2f}%; growth x{last}: disk "
        f"{res['staged_disk_growth']:.2f}x, "
        f"staged RSS {res['staged_rss_growth']:.2f}x, queue RSS {res['queue_rss_growth']:.2f}x"
    )
    if a.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
