"""Benchmark: early-stopped hooked capture vs a plain ``output_hidden_states`` forward.

For each model, one right-padded batch runs through
  * ``Target.capture`` (hooks on the tapped layers, forward stopped after the deepest one), and
  * the baseline ``model(..., output_hidden_states=True)`` (every layer, final norm, LM head),
interleaved, ``--repeats`` times each after a warm-up; the medians are compared as a ratio
(median of the per-repeat capture/baseline ratios, lower is better) together with real tokens/s and the activation
bytes each path returns. Runs on CPU with models built in code (random weights):

* ``dense-12x512``: a 12-layer Qwen3, hidden 512, vocab 16384;
* ``tiny-qwen3_5``: the tiny hybrid Qwen3.5 from ``dflash_staged.model.tiny`` (PyTorch reference kernels).

Usage: ``python bench/extract_bench.py [--json] [--repeats N] [--draft-layers K]``.
With ``--json`` the last line is a JSON object with all results.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from dflash_staged.config import dflash_target_layers
from dflash_staged.model.target import Target, pack_unpadded, pad_batch

LENGTHS = (256, 192, 160, 96)


def dense_model(seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def tiny_hybrid(seed: int = 0):
    from dflash_staged.model.tiny import build_tiny_model
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
    full_bytes = sum(h.numel() * h.element_size() for h in full.hidden_states) + \
        full.logits.numel() * full.logits.element_size()
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
        "model": name, "num_layers": L, "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size, "layer_ids": layer_ids, "batch": list(LENGTHS),
        "real_tokens": real_tokens, "padded_tokens": int(ids.numel()),
        "capture_s": round(cap_s, 5), "full_hidden_states_s": round(full_s, 5),
        "time_ratio": round(ratio, 3),
        "capture_tokens_per_s": round(real_tokens / cap_s, 1),
        "full_tokens_per_s": round(real_tokens / full_s, 1),
        "capture_bytes": cap_bytes, "full_output_bytes": full_bytes,
        "bytes_ratio": round(cap_bytes / full_bytes, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print a JSON object as the last line")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--draft-layers", type=int, default=5, help="drafter layers k for the DFlash tap rule")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 keeps timings steady on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    results = []
    for name, build in (("dense-12x512", dense_model), ("tiny-qwen3_5", tiny_hybrid)):
        r = bench_model(name, build(), args.draft_layers, args.repeats)
        results.append(r)
        print(f"{name}: taps {r['layer_ids']} of {r['num_layers']} layers, {r['real_tokens']} real tokens | "
              f"capture {r['capture_s'] * 1e3:.1f} ms ({r['capture_tokens_per_s']:.0f} tok/s) vs "
              f"output_hidden_states {r['full_hidden_states_s'] * 1e3:.1f} ms "
              f"({r['full_tokens_per_s']:.0f} tok/s): time ratio {r['time_ratio']:.2f}, "
              f"output bytes ratio {r['bytes_ratio']:.3f}")
    if args.json:
        print(json.dumps({"bench": "extract", "device": "cpu", "threads": args.threads,
                          "repeats": args.repeats, "draft_layers": args.draft_layers, "results": results}))


if __name__ == "__main__":
    main()
