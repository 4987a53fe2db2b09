"""Benchmark: early-stopped hooked capture vs a plain ``output_hidden_states`` forward.

For each model, one right-padded batch runs through
  * ``Target.capture`` (hooks on the tapped layers, forward stopped after the deepest one), and
  * the baseline ``model(..., output_hidden_states=True)`` (every layer, final norm, LM head),
interleaved, ``--repeats`` times each after a warm-up; the medians are compared as a ratio
(median of the per-repeat capture/baseline ratios, lower is better) together with real tokens/s and the
activation
bytes each path returns. Runs on CPU with models built in code (random weights):

* ``dense-12x512``: a 12-layer Qwen3, hidden 512, vocab 16384;
* ``tiny-qwen3_5``: the tiny hybrid Qwen3.5 from ``dflash_staged.model.target.tiny`` (PyTorch reference
  kernels).

``--tp`` adds the tensor-parallel plumbing figure: real tokens/s of ``dflash extract --tp 2 --devices
cpu,cpu`` (one worker, two processes under gloo) against ``dflash extract --devices cpu`` (one process),
each on its own copy of the same plan of ``dense-12x512`` (saved as an HF directory), interleaved
``--tp-repeats`` times. The rate counts the tokens of the jobs written after the first one, over the
time between them (model loading and process start-up excluded), with one torch thread per process:
TP=2 uses two cores where TP=1 uses one. On CPU the ratio checks the plumbing (the batch broadcast,
the followers' forwards, two all-reduces per layer); it is not a speed claim for GPUs.

Usage: ``python bench/extract_bench.py [--json] [--repeats N] [--draft-layers K] [--tp [--tp-repeats N]]``.
With ``--json`` the last line is a JSON object with all results.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_staged.config import dflash_target_layers
from dflash_staged.model.target import Target, pack_unpadded, pad_batch

LENGTHS = (256, 192, 160, 96)


def dense_model(seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=16384,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def tiny_hybrid(seed: int = 0):
    from dflash_staged.model.target.tiny import build_tiny_model

    return build_tiny_model("qwen3_5", seed=seed)


def bench_model(name: str, model, draft_layers: int, repeats: int) -> dict:
    L = model.config.num_hidden_layers
    layer_ids = dflash_target_layers(L, draft_layers)
    target = Target(model, layer_ids, f"bench:{name}", "cpu")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, model.config.vocab_size, (n,), generator=g) for n in LENGTHS]
    ids, mask, lengths = pad_batch(seqs)
    real_tokens = int(lengths.sum())

    def run_capture():
        return pack_unpadded(target.capture(ids, mask), lengths)

    def run_full():
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True)

    # warm-up, and the outputs' sizes
    taps = run_capture()
    full = run_full()
    cap_bytes = taps.numel() * taps.element_size()
    full_bytes = (
        sum(h.numel() * h.element_size() for h in full.hidden_states)
        + full.logits.numel() * full.logits.element_size()
    )
    for k, i in enumerate(layer_ids):  # sanity: the two paths agree on the tapped states
        ref = pack_unpadded(full.hidden_states[i + 1], lengths)
        assert torch.allclose(taps[:, k], ref, atol=1e-4), f"{name}: layer {i} differs"
    del full
    t_cap, t_full = [], []
    for _ in range(repeats):  # interleaved, so drift in machine load hits both alike
        t0 = time.perf_counter()
        run_capture()
        t_cap.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        run_full()
        t_full.append(time.perf_counter() - t0)
    cap_s, full_s = statistics.median(t_cap), statistics.median(t_full)
    # the ratio is the median of per-repeat ratios: each pair ran back to back under the same load
    ratio = statistics.median(c / f for c, f in zip(t_cap, t_full))
    return {
        "model": name,
        "num_layers": L,
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size,
        "layer_ids": layer_ids,
        "batch": list(LENGTHS),
        "real_tokens": real_tokens,
        "padded_tokens": int(ids.numel()),
        "capture_s": round(cap_s, 5),
        "full_hidden_states_s": round(full_s, 5),
        "time_ratio": round(ratio, 3),
        "capture_tokens_per_s": round(real_tokens / cap_s, 1),
        "full_tokens_per_s": round(real_tokens / full_s, 1),
        "capture_bytes": cap_bytes,
        "full_output_bytes": full_bytes,
        "bytes_ratio": round(cap_bytes / full_bytes, 3),
    }


def _extract_rate(mdir: Path, store: Path, devices: str, tp: int, env: dict) -> dict:
    """Run one ``dflash extract``; real tokens/s between its first and its last written job."""
    from dflash_staged.manifest import Manifest

    cmd = [
        sys.executable,
        "-m",
        "dflash_staged",
        "extract",
        "--manifest",
        str(mdir),
        "--store",
        str(store),
        "--devices",
        devices,
        "--tp",
        str(tp),
        "--window",
        "100000",
    ]
    t_start = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, float] = {}
    with Manifest.open(mdir, readonly=True) as m:
        tokens = {j.id: j.real_tokens for j in m.jobs()}
        while p.poll() is None:
            now = time.perf_counter()
            for j in m.jobs("written"):
                seen.setdefault(j.id, now)
            time.sleep(0.02)
        for j in m.jobs("written"):
            seen.setdefault(j.id, time.perf_counter())
    out = p.communicate()[0]
    if p.returncode != 0 or len(seen) != len(tokens):
        raise RuntimeError(f"extract --tp {tp} failed (rc {p.returncode}):\n{out[-2000:]}")
    order = sorted(seen, key=seen.get)
    span = seen[order[-1]] - seen[order[0]]
    return {
        "tp": tp,
        "devices": devices,
        "jobs": len(order),
        "wall_s": round(time.perf_counter() - t_start, 2),
        "tokens_after_first": sum(tokens[i] for i in order[1:]),
        "span_s": round(span, 3),
        "tokens_per_s": round(sum(tokens[i] for i in order[1:]) / max(span, 1e-9), 1),
    }


def bench_tp(repeats: int, n_samples: int = 96) -> dict:
    """TP=2 against TP=1 extract tokens/s on CPU, on the same plan (see the module docstring)."""
    import numpy as np

    from dflash_staged.model.target.tiny import build_tiny_tokenizer

    work = Path(tempfile.mkdtemp(prefix="dflash-tp-bench-"))
    try:
        model_dir = work / "dense-12x512"
        dense_model().save_pretrained(model_dir)
        build_tiny_tokenizer().save_pretrained(model_dir)
        rng = np.random.default_rng(0)
        data = work / "data.jsonl"
        with open(data, "w") as f:
            for _ in range(n_samples):
                n = int(rng.integers(64, 256))
                f.write(
                    json.dumps({"input_ids": rng.integers(4, 2048, n).tolist(), "loss_mask": [1] * n}) + "\n"
                )
        cfg = work / "bench.toml"
        cfg.write_text(
            f'[target]\nmodel = "{model_dir}"\ndtype = "float32"\n[data]\nmax_len = 256\n'
            "num_buckets = 2\ntoken_budget = 1024\n[drafter]\nnum_hidden_layers = 5\nmask_token_id = 3\n"
            "[train]\nmin_ready = 1\nbuffer_capacity = 1\n"
        )
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONWARNINGS": "ignore",
        }
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for r in range(repeats):  # interleaved, so drift in machine load hits both alike
            for tp, devices in ((1, "cpu"), (2, "cpu,cpu")):
                mdir = work / f"m{tp}-{r}"
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "dflash_staged",
                        "plan",
                        "--config",
                        str(cfg),
                        "--data",
                        str(data),
                        "--manifest",
                        str(mdir),
                    ],
                    env=env,
                    check=True,
                    capture_output=True,
                )
                runs[tp].append(_extract_rate(mdir, work / f"s{tp}-{r}", devices, tp, env))
        rate = {tp: statistics.median(x["tokens_per_s"] for x in v) for tp, v in runs.items()}
        return {
            "model": "dense-12x512",
            "repeats": repeats,
            "threads_per_process": 1,
            "tp1_tokens_per_s": rate[1],
            "tp2_tokens_per_s": rate[2],
            "tp2_over_tp1": round(rate[2] / rate[1], 3),
            "runs": runs[1] + runs[2],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print a JSON object as the last line")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--draft-layers", type=int, default=5, help="drafter layers k for the DFlash tap rule")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 keeps timings steady on a shared machine)"
    )
    ap.add_argument("--tp", action="store_true", help="also: dflash extract --tp 2 against --tp 1 on CPU")
    ap.add_argument("--tp-repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    results = []
    for name, build in (("dense-12x512", dense_model), ("tiny-qwen3_5", tiny_hybrid)):
        r = bench_model(name, build(), args.draft_layers, args.repeats)
        results.append(r)
        print(
            f"{name}: taps {r['layer_ids']} of {r['num_layers']} layers, {r['real_tokens']} real tokens | "
            f"capture {r['capture_s'] * 1e3:.1f} ms ({r['capture_tokens_per_s']:.0f} tok/s) vs "
            f"output_hidden_states {r['full_hidden_states_s'] * 1e3:.1f} ms "
            f"({r['full_tokens_per_s']:.0f} tok/s): time ratio {r['time_ratio']:.2f}, "
            f"output bytes ratio {r['bytes_ratio']:.3f}"
        )
    tp = None
    if args.tp:
        tp = bench_tp(args.tp_repeats)
        print(
            f"dflash extract on {tp['model']}, 1 thread per process: --tp 2 {tp['tp2_tokens_per_s']:.0f} "
            f"real tok/s vs --tp 1 {tp['tp1_tokens_per_s']:.0f} real tok/s: ratio {tp['tp2_over_tp1']:.2f} "
            f"(median of {tp['repeats']}; a plumbing figure on CPU, not a speed claim)"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "bench": "extract",
                    "device": "cpu",
                    "threads": args.threads,
                    "repeats": args.repeats,
                    "draft_layers": args.draft_layers,
                    "results": results,
                    "tp": tp,
                }
            )
        )


if __name__ == "__main__":
    main()
