"""Conversations/s of `dflash regenerate` through a server against the in-process path: same CPU, prompts.

The target is the demo's SmolLM2-135M-Instruct (``python demo/prepare.py prepare`` puts it in
``.cache/smollm2/hf``; ``--model`` takes another HF directory) and the prompts are the demo's templated chat
prompts (``demo/prompts.py``), answered greedily. For each thread count of ``--threads``, both paths answer
the same prompts, one after the other, with that many threads and the same batch width:

* in process: ``run_regenerate`` (one worker process, Hugging Face ``generate`` on batches of
  ``--batch-size``, float32); its time includes starting the worker and loading the model, as every run does;
* server: ``llama-server`` (this project's build, ``dflash serve build``) on the same weights as an f32 GGUF
  (llama.cpp's converter), f32 KV cache and plain attention (the precision of the in-process path), with
  ``--slots`` slots (default: the in-process batch) and as many conversations in flight; the server is
  started before the timing (a server is started once and answers many runs) and its start time is
  reported apart.

Reports conversations/s and new tokens/s of each path, their ratio (server / in process) and the ratio
without the in-process path's start (measured apart: a run answering one conversation with one token), the
share of answers identical on both paths, and the load average before and after each pair (the machine's
other work changes the timings; on a busy host one thread each avoids spin-waiting). Writes ``--out``
(JSON) and prints a summary.

    .venv/bin/python bench/regenerate_bench.py --out bench/results/regenerate_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demo"))

from dflash_staged.config import TargetConfig  # noqa: E402
from dflash_staged.fsutil import write_json_atomic  # noqa: E402
from dflash_staged.regenerate.command import run_regenerate  # noqa: E402
from dflash_staged.regenerate.options import GenOptions, ServerOptions  # noqa: E402
from dflash_staged.serve.llamacpp import build as llama_build  # noqa: E402
from dflash_staged.serve.llamacpp.convert import convert  # noqa: E402
from dflash_staged.serve.llamacpp.server import LlamaServer  # noqa: E402


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def timed(prompts: Path, o: GenOptions, **kw) -> dict:
    t0 = time.perf_counter()
    s = run_regenerate(prompts, o, **kw)
    wall = time.perf_counter() - t0
    return {
        "seconds": round(wall, 2),
        "conversations_per_s": round(s["conversations"] / wall, 3),
        "new_tokens_per_s": round(s["new_tokens"] / wall, 1),
        "new_tokens": s["new_tokens"],
    }


def answers(path: Path) -> list[str]:
    return [json.loads(x)["messages"][-1]["content"] for x in path.read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / ".cache" / "smollm2" / "hf")
    ap.add_argument("--n", type=int, default=32, help="conversations")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", default="1,2", help="thread counts to compare at, comma-separated")
    ap.add_argument("--batch-size", type=int, default=16, help="the in-process path's batch")
    ap.add_argument("--slots", type=int, default=None, help="llama-server's slots [default: --batch-size]")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "regenerate_bench.json")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        sys.exit(f"{args.model}: no model; run `python demo/prepare.py prepare` (or pass --model DIR)")
    if not llama_build.is_built("cpu"):
        sys.exit("llama-server is not built: run `dflash serve build` first")
    from prompts import build_prompts

    slots = args.slots or args.batch_size
    report = {
        "model": str(args.model),
        "settings": {k: v for k, v in vars(args).items() if k not in ("model", "out")},
        "cpus": os.cpu_count(),
        "load_before": load(),
        "pairs": [],
    }
    t0 = time.perf_counter()
    gguf = convert(args.model, args.model.parent / "target-f32.gguf", "f32")
    report["convert_s"] = round(time.perf_counter() - t0, 1)
    with tempfile.TemporaryDirectory(prefix="regen-bench-") as tmp:
        tmp = Path(tmp)
        src = tmp / "prompts.jsonl"
        rows = [{"messages": [{"role": "user", "content": p}]} for p in build_prompts(args.n, seed=7)]
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        src1 = tmp / "one.jsonl"
        src1.write_text(json.dumps(rows[0]) + "\n")
        target = TargetConfig(model=str(args.model))
        for threads in [int(t) for t in args.threads.split(",")]:
            os.environ["OMP_NUM_THREADS"] = str(threads)  # the in-process worker's torch threads
            opts = {
                name: GenOptions(target, tmp / f"{name}{threads}.jsonl", ["cpu"], args.max_new_tokens)
                for name in ("hf", "srv")
            }
            res = {"threads": threads, "load_before": load()}
            one = GenOptions(target, tmp / f"start{threads}.jsonl", ["cpu"], 1)
            res["in_process_start_s"] = timed(src1, one)["seconds"]  # worker start, model load, one token
            res["in_process"] = timed(src, opts["hf"], batch_size=args.batch_size)
            t_start = time.perf_counter()
            kw = dict(threads=threads, kv_type="f32", flash_attn="off", extra=("-np", str(slots)))
            with LlamaServer(llama_build.bin_dir("cpu"), gguf, tmp / f"server{threads}.log", **kw) as srv:
                res["server_start_s"] = round(time.perf_counter() - t_start, 2)
                res["server"] = timed(src, opts["srv"], server=ServerOptions([srv.url], concurrency=slots))
            a, b = answers(opts["hf"].out), answers(opts["srv"].out)
            res["identical_answers"] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
            res["ratio"] = round(
                res["server"]["conversations_per_s"] / res["in_process"]["conversations_per_s"], 2
            )
            hf_run = res["in_process"]["seconds"] - res["in_process_start_s"]
            res["ratio_without_start"] = round(res["server"]["conversations_per_s"] * hf_run / args.n, 2)
            res["load_after"] = load()
            report["pairs"].append(res)
            print(f"[regenerate-bench] {threads} thread(s): {json.dumps(res)}", flush=True)
    report["load_after"] = load()
    write_json_atomic(args.out, report)
    ratios = ", ".join(
        f"{r['ratio']}x ({r['ratio_without_start']}x without the start) at {r['threads']} thread(s)"
        for r in report["pairs"]
    )
    print(
        f"[regenerate-bench] server / in process, conversations/s: {ratios}; load {report['load_before']} -> "
        f"{report['load_after']}; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
