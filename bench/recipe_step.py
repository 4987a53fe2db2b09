"""A few training steps of the drafter at a recipe's shapes, through the trainer's own parts, with
the memory it used against what ``dflash_staged.train.memory`` expected.

The drafter is built from a config in code (random weights, the target's embedding and head random
too): the Qwen3-8B recipe (hidden 4096, MLP 12288, 5 layers, 32 heads of 128, 8 KV heads, vocab
151,936, block 16, 512 anchors) on CUDA in bf16 autocast; ``--small`` shrinks every width for a
CPU check of this script. Each step trains one synthetic shard of ``--tokens`` tokens in sequences
of ``--seq-len``, split into microbatches by tokens and by the row budget, then takes an AdamW step.

Prints one JSON line: tokens/s, the row budget, the estimated and measured peak (CUDA's
``max_memory_allocated``) and their ratio. Used by ``bench/gpu_smoke.py`` (step ``recipe_train``).
Usage: ``python bench/recipe_step.py [--device cuda|cpu] [--small] [--steps 3] [--checkpointing]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_staged.config import TrainConfig  # noqa: E402
from dflash_staged.model.drafter import DFlashDrafter, DraftModelConfig  # noqa: E402
from dflash_staged.train.distributed import Dist  # noqa: E402
from dflash_staged.train.loop import forward_backward, microbatches  # noqa: E402
from dflash_staged.train.objective import anchor_counts  # noqa: E402
from dflash_staged.train.optim import Optimizer  # noqa: E402
from dflash_staged.train.trained_drafter import DrafterModel  # noqa: E402

RECIPE = dict(
    hidden=4096, inter=12288, layers=5, heads=32, kv=8, head_dim=128, vocab=151936, block=16, anchors=512
)
SMALL = dict(hidden=128, inter=384, layers=2, heads=4, kv=2, head_dim=32, vocab=1024, block=16, anchors=32)


# The released Qwen DFlash2 drafters' architecture (docs/dflash2.md), on the same shapes.
DFLASH2 = dict(
    architecture="dflash2",
    layer_types=["sliding_attention"] * 5,
    sliding_window=2048,
    is_causal=False,
    conv_kernel_size=2,
    conv_group_size=16,
    selector_rank=256,
    selector_top_k=16,
)


def build(shape: dict, device: torch.device, arch: str = "dflash") -> DFlashDrafter:
    v2 = dict(DFLASH2, layer_types=["sliding_attention"] * shape["layers"]) if arch == "dflash2" else {}
    c = DraftModelConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        head_dim=shape["head_dim"],
        vocab_size=shape["vocab"],
        block_size=shape["block"],
        num_target_layers=36,
        target_layer_ids=[1, 9, 17, 25, 33],
        mask_token_id=shape["vocab"] - 1,
        dtype="bfloat16",
        rope_theta=1_000_000.0,
        **v2,
    )
    frozen = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        embed = (torch.randn(shape["vocab"], shape["hidden"]) * 0.02).to(frozen)
        head = (torch.randn(shape["vocab"], shape["hidden"]) * 0.02).to(frozen)
        return DFlashDrafter(c, embed, head)


def shard(tokens: int, seq_len: int, shape: dict, seed: int) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    n = max(1, tokens // seq_len)
    taps = 5
    return SimpleNamespace(
        hidden=torch.randn(n * seq_len, taps, shape["hidden"], generator=g).to(torch.bfloat16),
        input_ids=torch.randint(0, shape["vocab"] - 1, (n * seq_len,), generator=g),
        loss_mask=torch.ones(n * seq_len, dtype=torch.uint8),
        cu_seqlens=torch.arange(0, n * seq_len + 1, seq_len, dtype=torch.int64),
    )


def run(
    device: str,
    small: bool,
    steps: int,
    tokens: int,
    seq_len: int,
    checkpointing: bool,
    rows: int = 0,
    arch: str = "dflash",
) -> dict:
    dev = torch.device(device)
    shape = dict(SMALL if small else RECIPE, **({"block": 8} if arch == "dflash2" else {}))
    t = TrainConfig(
        num_anchors=shape["anchors"],
        microbatch_tokens=tokens,
        activation_checkpointing=checkpointing,
        microbatch_rows=rows,
        attention="auto",
        lr=1e-4,
    )
    drafter = build(shape, dev, arch)
    model = DrafterModel(drafter, t, dev, rank=0)  # states the memory it expects (CUDA)
    optim = Optimizer(model.params, t, Dist(dev))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, rows_seen, mbs_seen = [], 0, 0
    for step in range(steps):
        s = shard(tokens, seq_len, shape, step)
        rows = [c * shape["block"] for c in anchor_counts(s.loss_mask, s.cu_seqlens, t.num_anchors)]
        mbs = microbatches(s, t.microbatch_tokens, model.max_rows, rows)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        stats = forward_backward(model, mbs, dev, model.knobs(0, 1))
        optim.step(1e-4, stats["weight_sum"])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        rows_seen, mbs_seen = max(rows_seen, max(rows)), len(mbs)
    est_rows = min(model.max_rows or sum(rows), sum(rows))
    est = model.memory.peak(est_rows)
    measured = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    best = min(times[1:] or times)
    return {
        "shape": ("small" if small else "qwen3-8b recipe") + ("" if arch == "dflash" else f", {arch}"),
        "device": str(dev),
        "activation_checkpointing": checkpointing,
        "tokens_per_step": tokens,
        "seq_len": seq_len,
        "microbatches": mbs_seen,
        "row_budget": model.max_rows,
        "tokens_per_s": round(tokens / best),
        "step_s": [round(x, 3) for x in times],
        "estimated_peak_gib": round(est / 2**30, 2),
        "measured_peak_gib": None if measured is None else round(measured / 2**30, 2),
        "measured_over_estimate": None if measured is None else round(measured / est, 3),
        "loss": round(float(stats["loss_sum"] / stats["weight_sum"].clamp_min(1e-9)), 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small widths (a CPU check of the script)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=None, help="tokens a step [16384; 1024 with --small]")
    ap.add_argument("--seq-len", type=int, default=None, help="sequence length [1024; 128 with --small]")
    ap.add_argument("--checkpointing", action="store_true", help="train.activation_checkpointing = true")
    ap.add_argument("--rows", type=int, default=0, help="train.microbatch_rows [0: what fits the device]")
    ap.add_argument(
        "--architecture", default="dflash", choices=["dflash", "dflash2"], help="dflash2: block 8"
    )
    a = ap.parse_args()
    res = run(
        a.device,
        a.small,
        a.steps,
        a.tokens or (1024 if a.small else 16384),
        a.seq_len or (128 if a.small else 1024),
        a.checkpointing,
        a.rows,
        a.architecture,
    )
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
