"""Peak memory of ``dflash plan`` on large parquet files: the input is streamed, never held whole.

    python bench/data_bench.py [--rows 100000,1000000] [--row-group 10000] [--workdir DIR] [--json]

For each row count, a parquet file of token-id rows (``input_ids`` and ``loss_mask``, 8-40
tokens each, uniform) is written in pieces, then ``python -m dflash_staged plan`` runs on it
in a child process whose peak RSS (``ru_maxrss`` from ``wait4``) is taken. The baseline is the
same command on a 1,000-row file in the same run (interpreter, torch, transformers, pyarrow):
reported is each run's peak RSS, the growth over the baseline, and that growth per token of
the samples, whose own arrays (int32 ids + uint8 mask, npy files of the manifest) are O(tokens)
by design. Flat memory for the input means bytes per token stay the same from 100K to 1M rows.
The reference point, run on the same file in the same run, holds the input whole (the rows as
Python objects: ``pq.read_table(f).to_pylist()``); ``ratio`` is its growth over plan's (each over
its own 1,000-row baseline). ``--row-group 0`` writes one row group per file
(pyarrow's default up to 1Mi rows). With ``--json`` the last line is a JSON object.
The machine this runs on may be shared: timings are indicative, the memory figures are not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """[target]
model = "tiny:qwen3"
[data]
max_len = 64
num_buckets = 4
token_budget = 4096
min_loss_tokens = 1
[drafter]
num_hidden_layers = 2
block_size = 8
mask_token_id = 3
"""


def write_rows(path: Path, rows: int, row_group: int, seed: int = 0) -> int:
    """A parquet file of `rows` token-id rows, written 50,000 rows at a time; returns its token count."""
    rng = np.random.default_rng(seed)
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])
    tokens = 0
    with pq.ParquetWriter(path, schema) as w:
        for start in range(0, rows, 50_000):
            n = min(50_000, rows - start)
            lens = rng.integers(8, 41, n)
            offsets = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(lens, out=offsets[1:])
            ids = rng.integers(4, 2048, int(offsets[-1]), dtype=np.int32)
            mask = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lens) >= lens.repeat(lens) // 3
            table = pa.table(
                {
                    "input_ids": pa.ListArray.from_arrays(offsets, ids),
                    "loss_mask": pa.ListArray.from_arrays(offsets, mask.astype(np.int8)),
                },
                schema=schema,
            )
            w.write_table(table, row_group_size=row_group or None)
            tokens += int(offsets[-1])
    return tokens


def child_peak(args: list[str]) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of `python ARGS` in a child process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    t = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    if status:
        raise SystemExit(f"{args} failed:\n{out.decode()}")
    return usage.ru_maxrss / 1024, time.perf_counter() - t


# The reference point "the input held whole": the file's rows as Python objects at once.
WHOLE = "import sys, pyarrow.parquet as pq; rows = pq.read_table(sys.argv[1]).to_pylist(); print(len(rows))"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="100000,1000000")
    ap.add_argument("--row-group", type=int, default=10_000, help="rows per row group (0: one per file)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument(
        "--no-whole",
        dest="whole",
        action="store_false",
        help="skip the reference run that holds the input whole (read_table().to_pylist())",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dflash-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    config = work / "bench.toml"
    config.write_text(CONFIG)
    results = []
    for rows in [1000] + [int(x) for x in args.rows.split(",")]:
        data = work / f"rows-{rows}.parquet"
        tokens = write_rows(data, rows, args.row_group)
        manifest = work / f"manifest-{rows}"
        shutil.rmtree(manifest, ignore_errors=True)  # this run's own scratch: always plan afresh
        peak, secs = child_peak(
            [
                "-m",
                "dflash_staged",
                "plan",
                "--config",
                str(config),
                "--data",
                str(data),
                "--manifest",
                str(manifest),
            ]
        )
        shutil.rmtree(manifest)
        whole = child_peak(["-c", WHOLE, str(data)])[0] if args.whole else 0.0
        results.append(
            {
                "rows": rows,
                "tokens": tokens,
                "file_mib": round(data.stat().st_size / 2**20, 1),
                "sample_arrays_mib": round((tokens * 5 + rows * 8) / 2**20, 1),
                "peak_rss_mib": round(peak, 1),
                "seconds": round(secs, 1),
                "whole_peak_rss_mib": round(whole, 1),
            }
        )
        data.unlink()
    base, whole_base = results[0]["peak_rss_mib"], results[0]["whole_peak_rss_mib"]
    groups = f"{args.row_group:,} rows" if args.row_group else "one per file"
    print(
        f"baseline (1,000 rows): peak RSS {base:.0f} MiB"
        + (f" (input held whole: {whole_base:.0f} MiB)" if args.whole else "")
        + f"; row groups: {groups}"
    )
    print(
        f"{'rows':>10} {'tokens':>12} {'file MiB':>9} {'arrays MiB':>10} {'peak MiB':>9} {'growth':>8} "
        f"{'B/token':>8} {'s':>7}" + (f" {'whole: growth':>14} {'ratio':>6}" if args.whole else "")
    )
    for r in results[1:]:
        r["growth_mib"] = round(r["peak_rss_mib"] - base, 1)
        r["growth_bytes_per_token"] = round(r["growth_mib"] * 2**20 / r["tokens"], 2)
        r["whole_growth_mib"] = round(r["whole_peak_rss_mib"] - whole_base, 1)
        ratio = r["whole_growth_mib"] / r["growth_mib"] if r["growth_mib"] > 0 else float("nan")
        print(
            f"{r['rows']:>10,} {r['tokens']:>12,} {r['file_mib']:>9} {r['sample_arrays_mib']:>10} "
            f"{r['peak_rss_mib']:>9} {r['growth_mib']:>8} {r['growth_bytes_per_token']:>8} {r['seconds']:>7}"
            + (f" {r['whole_growth_mib']:>14} {ratio:>6.1f}" if args.whole else "")
        )
    if len(results) > 2:
        a, b = results[1], results[-1]
        print(
            f"bytes per token at {b['rows']:,} rows / at {a['rows']:,} rows: "
            f"{b['growth_bytes_per_token'] / a['growth_bytes_per_token']:.2f} (1.0 = flat)"
        )
    if args.json:
        print(
            json.dumps({"baseline_peak_rss_mib": base, "row_group": args.row_group, "results": results[1:]})
        )


if __name__ == "__main__":
    main()
