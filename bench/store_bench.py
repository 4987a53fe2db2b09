"""Shard store throughput against plain baselines, on the same bf16 hidden states.

    python bench/store_bench.py [--gib 1.0] [--runs 3] [--dir PATH] [--zstd] [--drop-caches] [--json]

Layout: K=5 tapped layers, H=4096, bf16 (40 KiB per token), shards of ~4096 tokens made of
ragged samples (64..1024 tokens). Methods, each writing and reading the same bytes:

  store        ShardStore.write_shard / read_shard (read includes the default XXH3-64 verification)
  store+zstd   the same with compression="zstd" (only with --zstd)
  store-inline the store's read as before it digested large files beside its reads (only with --inline):
               1 MiB reads, each digested in line; ``read_*_ratio_vs_inline`` is the store's against it
  store+fp8    the same in FP8 (only with --fp8): the write quantises the bf16 states on the CPU, the
               read dequantises them back to bf16 (both timed); GB/s count the same bf16 bytes, so a
               ratio against ``store`` is the speed of moving the same tokens
  fp8-io       the FP8 store's disk side alone (quantised before the timing, read without dequantising:
               on a GPU both happen on the device)
  numpy        one file per shard, ndarray.tofile of every array + fsync / np.fromfile
  torch.save   one torch.save file per sample (SpecForge/EAGLE offline style) + fsync / torch.load
  safetensors  one safetensors file per shard + fsync / load_file, materialized by clone()

Writes include fsync of every file. Reads are measured twice: "cold" after evicting the files
from the page cache (posix_fadvise DONTNEED on every file, which evicts its clean pages without
root and without touching other processes' cache; --drop-caches writes /proc/sys/vm/drop_caches
instead), so they measure the disk; and "warm"
straight after, from the page cache, so they measure CPU and memory bandwidth. Methods run
interleaved shard by shard, the order rotated each shard (the disk's speed drifts a lot on a
shared VM). A ratio (store / numpy, store / torch.save) is the median over shards of the
per-shard throughput ratio within a run (robust to bursts of disk speed), and the median of
that over runs is reported; the GB/s columns are total bytes / total time, median over runs. With --json the
last stdout line is
one JSON object. Other processes sharing the CPUs or the disk add noise: compare ratios, not
absolute numbers, across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_staged.store import ShardStore, StoreMeta  # noqa: E402
from dflash_staged.store.fp8 import dequantize, quantize  # noqa: E402

K, H, SHARD_TOKENS = 5, 4096, 4096


def make_data(gib: float, seed: int = 0) -> list[dict]:
    """Shards of ragged samples whose hidden states total ``gib`` GiB of bf16."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    total_tokens = int(gib * 2**30 / (K * H * 2))
    shards, done = [], 0
    while done < total_tokens:
        lengths = []
        while sum(lengths) < SHARD_TOKENS and done + sum(lengths) < total_tokens:
            lengths.append(int(rng.integers(64, 1025)))
        t = sum(lengths)
        cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int64)
        shards.append(
            {
                "hidden": torch.randn(t, K, H, generator=g).to(torch.bfloat16),
                "input_ids": torch.randint(4, 150000, (t,), generator=g, dtype=torch.int32),
                "loss_mask": torch.randint(0, 2, (t,), generator=g, dtype=torch.uint8),
                "cu_seqlens": cu,
                "sample_ids": torch.arange(len(lengths), dtype=torch.int64) + done,
            }
        )
        done += t
    return shards


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(root: Path, drop_caches: bool) -> str:
    """Drop ``root``'s files from the page cache; return how."""
    if drop_caches:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


# -------------------------------------------------------------------------- methods, one shard at a time


class Store:
    def __init__(self, compression: str, store_dtype: str = "target"):
        self.compression, self.store_dtype = compression, store_dtype

    def setup(self, d: Path, shards: list[dict]) -> None:  # untimed: a store is created once
        meta = StoreMeta(
            "bench", "bench", list(range(K)), H, "bfloat16", self.compression, store_dtype=self.store_dtype
        )
        self.s = ShardStore.create_or_open(d / "store", meta)
        self.infos = {}

    def write(self, d: Path, j: int, sh: dict) -> None:  # FP8: the quantisation (on the CPU) is timed too
        self.infos[j] = self.s.write_shard(0, j, **sh)

    def read(self, d: Path, j: int, sh: dict) -> None:  # FP8: and the dequantisation back to bf16
        shard = self.s.read_shard(0, j, expected_checksum=self.infos[j].checksum)
        if shard.hidden_scale is not None:
            dequantize(shard.hidden, shard.hidden_scale, torch.bfloat16)


class StoreInline(Store):
    """The store, read 1 MiB at a time with the digest in line (every file below the overlap threshold)."""

    def __init__(self):
        super().__init__("none")

    def read(self, d: Path, j: int, sh: dict) -> None:
        from dflash_staged.store import shardfiles

        was, shardfiles.OVERLAP_MIN = shardfiles.OVERLAP_MIN, 1 << 62
        try:
            super().read(d, j, sh)
        finally:
            shardfiles.OVERLAP_MIN = was


class StoreFp8Io(Store):
    """The FP8 store's disk side alone: states quantised before the timing (extract does it on the GPU),
    read without dequantising (the trainer does it on the GPU)."""

    def __init__(self):
        super().__init__("none", "float8_e4m3fn")

    def setup(self, d: Path, shards: list[dict]) -> None:
        super().setup(d, shards)
        self.q = [quantize(sh["hidden"]) for sh in shards]

    def write(self, d: Path, j: int, sh: dict) -> None:
        q, scale = self.q[j]
        self.infos[j] = self.s.write_shard(0, j, **{**sh, "hidden": q}, hidden_scale=scale)

    def read(self, d: Path, j: int, sh: dict) -> None:
        self.s.read_shard(0, j, expected_checksum=self.infos[j].checksum)


class Numpy:
    def setup(self, d: Path, shards: list[dict]) -> None:
        pass

    def write(self, d: Path, j: int, sh: dict) -> None:
        with open(d / f"{j}.bin", "wb") as f:
            for t in sh.values():
                (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tofile(f)
            f.flush()
            os.fsync(f.fileno())

    def read(self, d: Path, j: int, sh: dict) -> None:
        with open(d / f"{j}.bin", "rb") as f:
            for t in sh.values():
                dt = np.int16 if t.dtype == torch.bfloat16 else t.numpy().dtype
                out = torch.from_numpy(np.fromfile(f, dtype=dt, count=t.numel()).reshape(t.shape))
                if t.dtype == torch.bfloat16:
                    out = out.view(torch.bfloat16)


class TorchSave:
    def setup(self, d: Path, shards: list[dict]) -> None:  # per-sample tensors, split outside the timing
        self.samples = {}
        for j, sh in enumerate(shards):
            cu = sh["cu_seqlens"].tolist()
            self.samples[j] = [
                {
                    "hidden_states": sh["hidden"][a:e].clone(),
                    "input_ids": sh["input_ids"][a:e].clone(),
                    "loss_mask": sh["loss_mask"][a:e].clone(),
                }
                for a, e in zip(cu[:-1], cu[1:])
            ]

    def write(self, d: Path, j: int, sh: dict) -> None:
        for i, s in enumerate(self.samples[j]):
            with open(d / f"{j}_{i}.pt", "wb") as f:
                torch.save(s, f)
                f.flush()
                os.fsync(f.fileno())

    def read(self, d: Path, j: int, sh: dict) -> None:
        for i in range(len(self.samples[j])):
            torch.load(d / f"{j}_{i}.pt")


class Safetensors:
    def setup(self, d: Path, shards: list[dict]) -> None:
        pass

    def write(self, d: Path, j: int, sh: dict) -> None:
        save_file(sh, str(d / f"{j}.safetensors"))
        fsync_path(d / f"{j}.safetensors")

    def read(self, d: Path, j: int, sh: dict) -> None:  # load_file maps lazily: clone() materializes
        {k: t.clone() for k, t in load_file(str(d / f"{j}.safetensors")).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--zstd", action="store_true", help="also measure the store with zstd compression")
    ap.add_argument("--drop-caches", action="store_true", help="evict with /proc/sys/vm/drop_caches (root)")
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="also the store in FP8 (quantised in the write, dequantised in the read)",
    )
    ap.add_argument(
        "--inline", action="store_true", help="also the store's read with the digest in line (1 MiB reads)"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    shards = make_data(args.gib)
    nbytes = sum(t.numel() * t.element_size() for sh in shards for t in sh.values())
    methods = {
        "store": Store("none"),
        "numpy": Numpy(),
        "torch.save": TorchSave(),
        "safetensors": Safetensors(),
    }
    if args.zstd:
        methods["store+zstd"] = Store("zstd")
    if args.inline:
        methods["store-inline"] = StoreInline()
    if args.fp8:
        methods["store+fp8"] = Store("none", "float8_e4m3fn")
        methods["fp8-io"] = StoreFp8Io()
    scratch = Path(tempfile.mkdtemp(prefix="store-bench-", dir=args.dir))
    names = list(methods)
    res = {m: {"write": [], "read_cold": [], "read_warm": [], "disk": 0} for m in names}
    per_shard = []  # one {method: {kind: seconds per shard}} per run
    how = "?"
    try:
        for run in range(args.runs):
            dirs = {m: scratch / m.replace(".", "_").replace("+", "_") for m in names}
            secs = {m: {"write": [], "read_cold": [], "read_warm": []} for m in names}
            for m in names:
                dirs[m].mkdir()
                methods[m].setup(dirs[m], shards)
            for j, sh in enumerate(shards):  # interleave per shard so disk-speed drift hits all alike
                k = (run + j) % len(names)
                for m in names[k:] + names[:k]:
                    t0 = time.perf_counter()
                    methods[m].write(dirs[m], j, sh)
                    secs[m]["write"].append(time.perf_counter() - t0)
            for m in names:
                res[m]["disk"] = sum(p.stat().st_size for p in dirs[m].rglob("*") if p.is_file())
                how = evict(dirs[m], args.drop_caches)
            for kind in ("read_cold", "read_warm"):
                for j, sh in enumerate(shards):
                    k = (run + j) % len(names)
                    for m in names[k:] + names[:k]:
                        t0 = time.perf_counter()
                        methods[m].read(dirs[m], j, sh)
                        secs[m][kind].append(time.perf_counter() - t0)
            for m in names:
                for kind, sec in secs[m].items():
                    res[m][kind].append(nbytes / sum(sec) / 1e9)
                shutil.rmtree(dirs[m])
            per_shard.append(secs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def ratio(a: str, b: str, kind: str) -> float:
        """Throughput a / b: per run the median over shards of the time ratio, then the median over runs."""
        return statistics.median(
            statistics.median(tb / ta for ta, tb in zip(r[a][kind], r[b][kind])) for r in per_shard
        )

    print(
        f"{nbytes / 2**30:.2f} GiB in {len(shards)} shards (K={K}, H={H}, bf16), {args.runs} interleaved "
        f"runs, "
        f"cache eviction: {how}, cpus: {os.cpu_count()}, load: {os.getloadavg()[0]:.1f}"
    )
    print(f"{'method':<12} {'write GB/s':>10} {'read cold':>10} {'read warm':>10} {'disk/raw':>9}")
    for m in names:
        r = res[m]
        print(
            f"{m:<12} {statistics.median(r['write']):>10.2f} {statistics.median(r['read_cold']):>10.2f} "
            f"{statistics.median(r['read_warm']):>10.2f} {r['disk'] / nbytes:>9.3f}"
        )
    summary = {
        "gib": nbytes / 2**30,
        "runs": args.runs,
        "eviction": how,
        "shards": len(shards),
        "write_ratio_vs_raw": ratio("store", "numpy", "write"),
        "read_ratio_vs_raw": ratio("store", "numpy", "read_cold"),
        "read_warm_ratio_vs_raw": ratio("store", "numpy", "read_warm"),
        "write_ratio_vs_torch_save": ratio("store", "torch.save", "write"),
        "read_ratio_vs_torch_save": ratio("store", "torch.save", "read_cold"),
        **(
            {
                f"{m.replace('store+', '').replace('-', '_')}_{k}_ratio_vs_store": ratio(m, "store", k)
                for m in ("store+fp8", "fp8-io")
                for k in ("write", "read_cold", "read_warm")
            }
            if args.fp8
            else {}
        ),
        **(
            {f"{k}_ratio_vs_inline": ratio("store", "store-inline", k) for k in ("read_cold", "read_warm")}
            if args.inline
            else {}
        ),
        "gbps": {
            m: {k: statistics.median(res[m][k]) for k in ("write", "read_cold", "read_warm")} for m in names
        },
        "disk_ratio": {m: res[m]["disk"] / nbytes for m in names},
    }
    print(
        "ratios (median of per-run store/baseline): "
        + ", ".join(
            f"{k}={v:.2f}"
            for k, v in summary.items()
            if k.endswith(("raw", "torch_save", "vs_store", "vs_inline"))
        )
    )
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
