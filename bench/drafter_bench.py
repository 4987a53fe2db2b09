"""Drafter training cost on CPU: forward+backward throughput and where the time goes.

    python bench/drafter_bench.py [--hidden 256] [--vocab 8192] [--layers 2] [--seqs 4] [--seq-len 256]
                                  [--anchors 32] [--block 16] [--loss-chunk 1024] [--runs 5] [--threads N] [--json]

One microbatch of packed sequences with random target features (K=3 taps) and a
random frozen embedding / LM head. Measured, interleaved, median over ``--runs``:

  step         dflash_loss forward + backward (anchors, drafter, chunked LM head + CE)
  head         the chunked LM head + weighted CE alone, forward + backward, same rows
  head_naive   baseline: F.linear + F.cross_entropy under autograd (all logits kept)
  many_anchor  forward_train for all anchors in one pass (no grad)
  one_by_one   baseline: draft_block per anchor, context cut at the anchor (no grad), timed on
               ``--loop-anchors`` anchors spread over the batch and scaled to all anchors

Reported: context tokens/s and block positions/s of ``step``; the share of ``step``
spent in the LM head + loss (``head / step``); ``head / head_naive`` (the price of
bounded memory, ~1 means none) with the logits memory each keeps alive; and
``one_by_one / many_anchor`` (the speedup of the block-mask pass). With --json the
last stdout line is one JSON object. Ratios are taken within a run; other
processes on the CPUs add noise to absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_staged.model.drafter import DFlashDrafter, DraftModelConfig  # noqa: E402
from dflash_staged.train.objective import block_labels, decay_weights, dflash_loss, head_loss, sample_anchors  # noqa: E402

K = 3


def build(a):
    g = torch.Generator().manual_seed(0)
    heads = max(1, a.hidden // 64)
    dcfg = DraftModelConfig(hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
                            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                            vocab_size=a.vocab, block_size=a.block, num_target_layers=12,
                            target_layer_ids=[1, 5, 9][:K], mask_token_id=a.vocab - 1, dtype="float32")
    torch.manual_seed(0)
    m = DFlashDrafter(dcfg, torch.randn(a.vocab, a.hidden, generator=g),
                      torch.randn(a.vocab, a.hidden, generator=g) / a.hidden ** 0.5)
    T = a.seqs * a.seq_len
    batch = {"hidden": torch.randn(T, K, a.hidden, generator=g),
             "input_ids": torch.randint(0, a.vocab - 1, (T,), generator=g),
             "loss_mask": torch.ones(T), "cu_seqlens": torch.arange(a.seqs + 1) * a.seq_len}
    return m, batch


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--loss-chunk", type=int, default=1024)
    p.add_argument("--loop-anchors", type=int, default=16, help="anchors timed in the one_by_one baseline")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    m, batch = build(a)
    B, T = a.block, a.seqs * a.seq_len
    anchors = sample_anchors(batch["loss_mask"], batch["cu_seqlens"], B, a.anchors, torch.Generator().manual_seed(0))
    A = anchors.numel()
    labels, valid = block_labels(batch["input_ids"], batch["loss_mask"], batch["cu_seqlens"], anchors, B)
    w = (decay_weights(B, 7.0)[None] * valid).reshape(-1)
    labels = labels.reshape(-1)
    with torch.no_grad():
        h0 = m.forward_train(batch["hidden"], batch["input_ids"], batch["cu_seqlens"], anchors)[:, 1:]
        h0 = h0.reshape(-1, a.hidden).contiguous()
    W = m.lm_head_weight

    def step():
        m.zero_grad(set_to_none=True)
        loss, _ = dflash_loss(m, batch, a.anchors, 7.0, torch.Generator().manual_seed(0), loss_chunk=a.loss_chunk)
        loss.backward()

    def head():
        h = h0.clone().requires_grad_()
        head_loss(h, W, labels, w, a.loss_chunk)[0].backward()

    def head_naive():
        h = h0.clone().requires_grad_()
        ((F.cross_entropy(h @ W.t(), labels, reduction="none") * w).sum() / w.sum()).backward()

    def many_anchor():
        with torch.no_grad():
            m.forward_train(batch["hidden"], batch["input_ids"], batch["cu_seqlens"], anchors)

    cu = batch["cu_seqlens"]

    subset = anchors[:: max(1, A // a.loop_anchors)].tolist()

    def one_by_one():  # a spread-out subset; its time is scaled to all A anchors below
        with torch.no_grad():
            for t in subset:
                s = int(cu[torch.searchsorted(cu, t, right=True) - 1])
                m.draft_block(batch["hidden"][s:t], batch["input_ids"][t])

    fns = {"step": step, "head": head, "head_naive": head_naive, "many_anchor": many_anchor,
           "one_by_one": one_by_one}
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    ratios: dict[str, list[float]] = {"head_share": [], "head_vs_naive": [], "one_by_one_vs_many": []}
    for r in range(a.runs):
        names = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]  # rotate the order
        t = {k: timed(fns[k]) for k in names}
        for k, v in t.items():
            times[k].append(v)
        ratios["head_share"].append(t["head"] / t["step"])
        ratios["head_vs_naive"].append(t["head"] / t["head_naive"])
        ratios["one_by_one_vs_many"].append(t["one_by_one"] * A / len(subset) / t["many_anchor"])
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = A * (B - 1)
    result = {
        "config": {"hidden": a.hidden, "vocab": a.vocab, "layers": a.layers, "block": B, "context_tokens": T,
                   "anchors": A, "head_rows": rows, "loss_chunk": a.loss_chunk, "threads": torch.get_num_threads()},
        "step_s": med["step"],
        "context_tokens_per_s": T / med["step"],
        "block_positions_per_s": A * B / med["step"],
        "head_share_of_step": statistics.median(ratios["head_share"]),
        "head_chunked_vs_naive_time": statistics.median(ratios["head_vs_naive"]),
        "logits_mib_kept_chunked": min(a.loss_chunk, rows) * a.vocab * 4 / 2**20,
        "logits_mib_kept_naive": rows * a.vocab * 4 / 2**20,
        "one_by_one_vs_many_anchor_time": statistics.median(ratios["one_by_one_vs_many"]),
        "median_s": med,
    }
    print(f"drafter fwd+bwd: {result['context_tokens_per_s']:.0f} context tok/s, "
          f"{result['block_positions_per_s']:.0f} block positions/s ({T} tokens, {A} anchors, B={B}, "
          f"H={a.hidden}, V={a.vocab}, {a.layers} layers, {torch.get_num_threads()} threads)")
    print(f"LM head + loss: {100 * result['head_share_of_step']:.0f}% of the step; chunked/naive time "
          f"{result['head_chunked_vs_naive_time']:.2f}, logits kept {result['logits_mib_kept_chunked']:.0f} MiB "
          f"vs {result['logits_mib_kept_naive']:.0f} MiB")
    print(f"many-anchor pass vs one block at a time: {result['one_by_one_vs_many_anchor_time']:.1f}x faster")
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
