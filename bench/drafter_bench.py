"""Drafter training cost: forward+backward throughput, where the time goes, and the attention paths.

    python bench/drafter_bench.py [--hidden 256] [--vocab 8192] [--layers 2] [--seqs 4] [--seq-len 256]
                                  [--anchors 32] [--block 16] [--loss-chunk 1024] [--runs 5] [--threads N]
                                  [--json]
    python bench/drafter_bench.py --attention [--device cpu|cuda] [--runs 3] [--json]

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

``--attention`` (speedups are today's time over the path's; on a shared CPU the process CPU
times are the steadier figure, and both are printed) compares the ways ``forward_train`` evaluates the DFlash
mask on recipe-like
shapes (one sequence, one anchor per 6 tokens, block 16; GQA 4:1), in one run:

  today        the dense path as it was: chunks of about Lmax/B anchors, each against the whole
               padded context, K/V repeated per query head (the baseline)
  dense_cut    the SDPA path now: finer chunks, each chunk's keys cut to what its anchors can
               see, GQA without repeats on CPU
  flex         block-sparse flex_attention (CUDA: compiled, fwd+bwd; CPU: eager, forward
               only, since flex has no CPU backward, and the eager kernel materialises scores)

Reported per path: attention FLOPs computed and the share of them the mask needs, forward
time, fwd+bwd step time and training tokens/s (context tokens per step second), and peak
memory of one fwd+bwd step (CUDA: ``max_memory_allocated``; CPU: peak RSS growth of a fresh
process running only that path). ``--device cuda`` defaults to the recipe itself (Qwen3-8B
geometry, 5 layers, block 16, 512 anchors, 3072 tokens, bf16 autocast).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_staged.model.drafters import attention as block_attention  # noqa: E402
from dflash_staged.model.drafters.attention import SdpaBlocks  # noqa: E402
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig  # noqa: E402
from dflash_staged.train.objective import (  # noqa: E402
    block_labels,
    decay_weights,
    dflash_loss,
    head_loss,
    sample_anchors,
)

K = 3


def build(a, heads=None, kv=None, head_dim=64, inter=None, taps=K, device="cpu"):
    g = torch.Generator().manual_seed(0)
    heads = heads or max(1, a.hidden // 64)
    dcfg = DraftModelConfig(
        hidden_size=a.hidden,
        intermediate_size=inter or 3 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=heads,
        num_key_value_heads=kv or max(1, heads // 2),
        head_dim=head_dim,
        vocab_size=a.vocab,
        block_size=a.block,
        num_target_layers=36,
        target_layer_ids=[1, 9, 17, 25, 33][:taps],
        mask_token_id=a.vocab - 1,
        dtype="float32",
    )
    torch.manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    m = DFlashDrafter(
        dcfg,
        torch.randn(a.vocab, a.hidden, generator=g).to(dt),
        (torch.randn(a.vocab, a.hidden, generator=g) / a.hidden**0.5).to(dt),
    ).to(device)
    T = a.seqs * a.seq_len
    batch = {
        "hidden": torch.randn(T, taps, a.hidden, generator=g).to(device, dt),
        "input_ids": torch.randint(0, a.vocab - 1, (T,), generator=g).to(device),
        "loss_mask": torch.ones(T, device=device),
        "cu_seqlens": (torch.arange(a.seqs + 1) * a.seq_len).to(device),
    }
    return m, batch


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# -- --attention: the ways forward_train evaluates the mask ------------------------------------------
SHAPES = {
    "cpu": dict(hidden=256, vocab=8192, layers=2, seqs=1, seq_len=768, anchors=128, block=16),
    "cuda": dict(hidden=4096, vocab=151936, layers=5, seqs=1, seq_len=3072, anchors=512, block=16),
}
GEOMETRY = {
    "cpu": dict(heads=8, kv=2, head_dim=32, inter=768, taps=3),
    "cuda": dict(heads=32, kv=8, head_dim=128, inter=12288, taps=5),
}  # Qwen3-8B
VARIANTS = ("today", "dense_cut", "flex")


def sdpa_repeating(q, k, v, mask=None):
    """The baseline's SDPA: K/V repeated per query head (what every path did before)."""
    groups = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(groups, dim=-3) for t in (k, v))
    return F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, attn_mask=mask)


def chunk_as_before(N, M, Lmax, B, nheads, dev):
    """The baseline's anchor chunks: c*B about the longest sequence (no keys were cut then)."""
    per_key = N * (1 if dev.type == "cuda" else nheads)
    c = max(1, min(M, max(Lmax, 16 * B) // B))
    while c > 1 and per_key * c * B * (Lmax + c * B) > block_attention.ATTN_CHUNK_ELEMS:
        c = (c + 1) // 2
    return c


@contextlib.contextmanager
def variant(name: str):
    saved = block_attention.sdpa, block_attention.anchor_chunk
    if name == "today":
        block_attention.sdpa, block_attention.anchor_chunk = sdpa_repeating, chunk_as_before
    try:
        yield
    finally:
        block_attention.sdpa, block_attention.anchor_chunk = saved


def attention_of(name: str, m, made: list):
    def build(pk, kinds):
        if name == "flex":
            from dflash_staged.model.drafters.flex import FlexBlocks

            blocks = FlexBlocks(pk, kinds)
        else:
            blocks = SdpaBlocks(pk, m.dcfg.num_attention_heads, kinds, cut_keys=name != "today")
        made.append(blocks)
        return blocks

    return build


def attention_case(a):
    """(drafter, batch, forward, step) for the --attention shapes on a.device."""
    m, batch = build(a, **GEOMETRY[a.device], device=a.device)
    anchors = sample_anchors(
        batch["loss_mask"], batch["cu_seqlens"], a.block, a.anchors, torch.Generator().manual_seed(0)
    )
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if a.device == "cuda" else contextlib.nullcontext()
    )

    def forward(name, made):
        with torch.no_grad(), autocast, variant(name):
            m.forward_train(
                batch["hidden"], batch["input_ids"], batch["cu_seqlens"], anchors, attention_of(name, m, made)
            )

    def step(name, made):
        m.zero_grad(set_to_none=True)
        with autocast, variant(name):
            loss, _ = dflash_loss(
                m,
                batch,
                a.anchors,
                7.0,
                torch.Generator(a.device).manual_seed(0),
                loss_chunk=a.loss_chunk,
                attention=attention_of(name, m, made),
            )
        loss.backward()

    return m, anchors, forward, step


def sync(a):
    if a.device == "cuda":
        torch.cuda.synchronize()


def peak_of(a, name, case=None) -> float:
    """MiB: one fwd+bwd step's peak memory (forward only for flex on CPU)."""
    m, _, forward, step = case or attention_case(a)
    run = forward if (name == "flex" and a.device == "cpu") else step
    if a.device == "cuda":
        run(name, [])  # compile / warm up
        sync(a)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(name, [])
        sync(a)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak RSS (VmHWM) to the current RSS
    base = proc_status_kib("VmRSS")
    run(name, [])
    return (proc_status_kib("VmHWM") - base) / 1024


def proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def attention_main(a) -> None:
    for k, v in SHAPES[a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.peak_of:
        print(json.dumps({"peak_mib": peak_of(a, a.peak_of)}))
        return
    case = m, anchors, forward, step = attention_case(a)
    g = GEOMETRY[a.device]
    T, pair_flops = a.seqs * a.seq_len, 4 * g["head_dim"] * g["heads"]
    res: dict[str, dict] = {}
    for name in VARIANTS:
        made: list = []
        t0 = time.perf_counter()
        forward(name, made)  # warm-up (flex on CUDA: compiles)
        sync(a)
        first = time.perf_counter() - t0
        pk = made[0].pk
        kinds = [layer.self_attn.kind for layer in m.layers]
        needed = sum(pk.needed_pairs(k) for k in kinds)
        computed = made[0].computed if name != "flex" else sum(made[0].computed_pairs(k) for k in kinds)
        res[name] = {
            "first_call_s": first,
            "attn_gflop_computed": computed * pair_flops / 1e9,
            "attn_gflop_needed": needed * pair_flops / 1e9,
            "needed_share": needed / computed,
            "fwd_s": [],
            "step_s": [],
            "fwd_cpu_s": [],
            "step_cpu_s": [],
        }
    trainable = [n for n in VARIANTS if not (n == "flex" and a.device == "cpu")]
    for r in range(a.runs):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for name in order:
            for key, fn in (("fwd", forward), ("step", step)):
                if key == "step" and name not in trainable:
                    continue
                t, c = time.perf_counter(), time.process_time()
                fn(name, [])
                sync(a)
                res[name][f"{key}_s"].append(time.perf_counter() - t)
                res[name][f"{key}_cpu_s"].append(time.process_time() - c)
    for name in VARIANTS:
        v = res[name]
        for key in ("fwd_s", "step_s", "fwd_cpu_s", "step_cpu_s"):
            v[key] = statistics.median(v[key]) if v[key] else None
        v["train_tokens_per_s"] = T / v["step_s"] if v["step_s"] else None
        if a.device == "cuda":
            v["peak_mib"] = peak_of(a, name, case)
        else:  # a fresh process per path, so one path's peak cannot hide another's
            argv = [sys.executable, __file__, "--attention", "--device", "cpu", "--peak-of", name]
            for k in SHAPES["cpu"]:
                argv += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
            out = subprocess.run(argv, capture_output=True, text=True, check=True)
            v["peak_mib"] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]
    base = res["today"]
    for name in VARIANTS:
        v = res[name]
        v["fwd_speedup_vs_today"] = base["fwd_s"] / v["fwd_s"]
        v["step_speedup_vs_today"] = base["step_s"] / v["step_s"] if v["step_s"] else None
        v["step_cpu_time_ratio_today_over_this"] = (
            base["step_cpu_s"] / v["step_cpu_s"] if v["step_cpu_s"] else None
        )
        v["peak_vs_today"] = v["peak_mib"] / base["peak_mib"] if base["peak_mib"] > 0 else None
    cfg = (
        {k: getattr(a, k) for k in SHAPES[a.device]}
        | g
        | {"device": a.device, "threads": torch.get_num_threads(), "anchors_drawn": int(anchors.numel())}
    )
    print(f"attention paths, {cfg}")
    for name in VARIANTS:
        v = res[name]
        step_txt = (
            f"step {v['step_s']:.3f} s ({v['train_tokens_per_s']:.0f} tok/s, "
            f"{v['step_speedup_vs_today']:.2f}x; "
            f"process CPU time {v['step_cpu_s']:.3f} s, {v['step_cpu_time_ratio_today_over_this']:.2f}x)"
            if v["step_s"]
            else "step n/a (no flex backward on CPU)"
        )
        print(
            f"  {name:9s} attn {v['attn_gflop_computed']:8.2f} GFLOP computed, "
            f"{100 * v['needed_share']:5.1f}% needed | "
            f"fwd {v['fwd_s']:.3f} s ({v['fwd_speedup_vs_today']:.2f}x) | {step_txt} | peak "
            f"{v['peak_mib']:.0f} MiB" + (" (forward only)" if name == "flex" and a.device == "cpu" else "")
        )
    if a.json:
        print(json.dumps({"config": cfg, "paths": res}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attention", action="store_true", help="compare the attention paths (see the docstring)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="--attention only")
    p.add_argument("--peak-of", default=None, choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seqs", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--anchors", type=int, default=None, help="anchors per sequence")
    p.add_argument("--block", type=int, default=None)
    p.add_argument("--loss-chunk", type=int, default=1024)
    p.add_argument("--loop-anchors", type=int, default=16, help="anchors timed in the one_by_one baseline")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.attention:
        return attention_main(a)
    for k, v in dict(hidden=256, vocab=8192, layers=2, seqs=4, seq_len=256, anchors=32, block=16).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    m, batch = build(a)
    B, T = a.block, a.seqs * a.seq_len
    anchors = sample_anchors(
        batch["loss_mask"], batch["cu_seqlens"], B, a.anchors, torch.Generator().manual_seed(0)
    )
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
        loss, _ = dflash_loss(
            m, batch, a.anchors, 7.0, torch.Generator().manual_seed(0), loss_chunk=a.loss_chunk
        )
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

    fns = {
        "step": step,
        "head": head,
        "head_naive": head_naive,
        "many_anchor": many_anchor,
        "one_by_one": one_by_one,
    }
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    ratios: dict[str, list[float]] = {"head_share": [], "head_vs_naive": [], "one_by_one_vs_many": []}
    for r in range(a.runs):
        names = list(fns)[r % len(fns) :] + list(fns)[: r % len(fns)]  # rotate the order
        t = {k: timed(fns[k]) for k in names}
        for k, v in t.items():
            times[k].append(v)
        ratios["head_share"].append(t["head"] / t["step"])
        ratios["head_vs_naive"].append(t["head"] / t["head_naive"])
        ratios["one_by_one_vs_many"].append(t["one_by_one"] * A / len(subset) / t["many_anchor"])
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = A * (B - 1)
    result = {
        "config": {
            "hidden": a.hidden,
            "vocab": a.vocab,
            "layers": a.layers,
            "block": B,
            "context_tokens": T,
            "anchors": A,
            "head_rows": rows,
            "loss_chunk": a.loss_chunk,
            "threads": torch.get_num_threads(),
        },
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
    print(
        f"drafter fwd+bwd: {result['context_tokens_per_s']:.0f} context tok/s, "
        f"{result['block_positions_per_s']:.0f} block positions/s ({T} tokens, {A} anchors, B={B}, "
        f"H={a.hidden}, V={a.vocab}, {a.layers} layers, {torch.get_num_threads()} threads)"
    )
    print(
        f"LM head + loss: {100 * result['head_share_of_step']:.0f}% of the step; chunked/naive time "
        f"{result['head_chunked_vs_naive_time']:.2f}, logits kept {result['logits_mib_kept_chunked']:.0f} "
        f"MiB "
        f"vs {result['logits_mib_kept_naive']:.0f} MiB"
    )
    print(f"many-anchor pass vs one block at a time: {result['one_by_one_vs_many_anchor_time']:.1f}x faster")
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
