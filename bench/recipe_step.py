"""A few training steps of the drafter at a recipe's shapes, through the trainer's own parts, with
the memory it used against what ``dflash_staged.train.memory`` expected.

The drafter is built from a config in code (random weights, the target's embedding and head random
too): the Qwen3-8B recipe (hidden 4096, MLP 12288, 5 layers, 32 heads of 128, 8 KV heads, vocab
151,936, block 16, 512 anchors) on CUDA in bf16 autocast; ``--small`` shrinks every width for a
CPU check of this script. Each step trains one synthetic shard of ``--tokens`` tokens in sequences
of ``--seq-len``, split into microbatches by tokens and by the row budget, then takes an AdamW step.

Prints one JSON line: tokens/s, the row budget, the largest microbatch's rows, the estimated peak at
that microbatch and the measured one (CUDA's ``max_memory_allocated``) and their ratio, and the
flex block mask's build time a step (``--uneven``: sequence lengths that pad the rows; ``--loss``: a
loss on the target's distribution, with its logits recomputed from a stored last layer). Used by
``bench/gpu_smoke.py`` (step ``recipe_train``).
Usage: ``python bench/recipe_step.py [--device cuda|cpu] [--small] [--steps 3] [--checkpointing] [--uneven]
[--loss ce=0.1,tv=0.9]``.
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
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig  # noqa: E402
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


def lengths_for(tokens: int, seq_len: int, uneven: bool, seed: int) -> list[int]:
    """Sequence lengths of one step: ``tokens // seq_len`` of ``seq_len``, or (``uneven``) lengths drawn
    between a quarter and twice ``seq_len`` up to ``tokens``, so the drafter rows a microbatch holds
    (anchors x block) are not a power of two and flex pads them."""
    if not uneven:
        return [seq_len] * max(1, tokens // seq_len)
    g = torch.Generator().manual_seed(1000 + seed)
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(torch.randint(max(2, seq_len // 4), 2 * seq_len, (1,), generator=g)))
    out[-1] -= sum(out) - tokens
    return [x for x in out if x >= 2]


def shard(lengths: list[int], shape: dict, seed: int, last_layer: bool = False) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    taps = 5 + (1 if last_layer else 0)  # the target's last layer after the taps, when a loss needs it
    return SimpleNamespace(
        hidden=torch.randn(T, taps, shape["hidden"], generator=g).to(torch.bfloat16),
        input_ids=torch.randint(0, shape["vocab"] - 1, (T,), generator=g),
        loss_mask=torch.ones(T, dtype=torch.uint8),
        cu_seqlens=torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64),
    )


class MaskClock:
    """Seconds spent building flex block masks (``FlexBlocks.__init__``, synchronised on CUDA)."""

    def __init__(self, dev: torch.device):
        from dflash_staged.model.drafters import flex as flex_blocks

        self.dev, self.seconds, real = dev, 0.0, flex_blocks.FlexBlocks.__init__

        def timed(blocks, *a, **kw):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            real(blocks, *a, **kw)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            self.seconds += time.perf_counter() - t0

        flex_blocks.FlexBlocks.__init__ = timed


def run(
    device: str,
    small: bool,
    steps: int,
    tokens: int,
    seq_len: int,
    checkpointing: bool,
    rows: int = 0,
    arch: str = "dflash",
    uneven: bool = False,
    loss: dict | None = None,
) -> dict:
    from dflash_staged.model.target.weights import FinalNorm

    dev = torch.device(device)
    shape = dict(SMALL if small else RECIPE, **({"block": 8} if arch == "dflash2" else {}))
    t = TrainConfig(
        num_anchors=shape["anchors"],
        microbatch_tokens=tokens,
        activation_checkpointing=checkpointing,
        microbatch_rows=rows,
        attention="auto",
        lr=1e-4,
        **({"loss": loss} if loss else {}),
    )
    drafter = build(shape, dev, arch)
    norm = FinalNorm(torch.ones(shape["hidden"]), 1e-6).to(dev) if t.needs_target else None
    model = DrafterModel(drafter, t, dev, rank=0, target_norm=norm)  # states the memory it expects (CUDA)
    optim = Optimizer(model.params, t, Dist(dev))
    clock = MaskClock(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, mask_s, biggest, mbs_seen, tokens_seen = [], [], 0, 0, 0
    for step in range(steps):
        s = shard(lengths_for(tokens, seq_len, uneven, step), shape, step, last_layer=t.needs_target)
        rows = [c * shape["block"] for c in anchor_counts(s.loss_mask, s.cu_seqlens, t.num_anchors)]
        mbs = microbatches(s, t.microbatch_tokens, model.max_rows, rows)
        for mb in mbs:  # the largest microbatch run: the one the estimate is for
            mb_rows = sum(
                c * shape["block"] for c in anchor_counts(mb["loss_mask"], mb["cu_seqlens"], t.num_anchors)
            )
            biggest = max(biggest, mb_rows)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        clock.seconds = 0.0
        t0 = time.perf_counter()
        stats = forward_backward(model, mbs, dev, model.knobs(0, 1))
        optim.step(1e-4, stats["weight_sum"])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        mask_s.append(clock.seconds)
        mbs_seen, tokens_seen = max(mbs_seen, len(mbs)), int(s.input_ids.numel())
    est = model.memory.peak(biggest)
    measured = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    warm = times[1:] or times
    best = min(warm)
    i = times.index(best)
    return {
        "shape": ("small" if small else "qwen3-8b recipe") + ("" if arch == "dflash" else f", {arch}"),
        "device": str(dev),
        "activation_checkpointing": checkpointing,
        "loss_terms": t.loss,
        "uneven": uneven,
        "tokens_per_step": tokens_seen,
        "seq_len": seq_len,
        "microbatches": mbs_seen,
        "row_budget": model.max_rows,
        "largest_microbatch_rows": biggest,
        "rows_power_of_two": biggest & (biggest - 1) == 0,
        "tokens_per_s": round(tokens_seen / best),
        "step_s": [round(x, 3) for x in times],
        "mask_build_s": round(mask_s[i], 4),
        "mask_build_share": round(mask_s[i] / best, 4),
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
    ap.add_argument("--uneven", action="store_true", help="uneven sequence lengths (rows not a power of 2)")
    ap.add_argument(
        "--loss", default="", help="train.loss terms, e.g. ce=0.1,tv=0.9 (the target's logits too)"
    )
    a = ap.parse_args()
    loss = {k: float(v) for k, v in (x.split("=") for x in a.loss.split(",") if x)} or None
    res = run(
        a.device,
        a.small,
        a.steps,
        a.tokens or (1024 if a.small else 16384),
        a.seq_len or (128 if a.small else 1024),
        a.checkpointing,
        a.rows,
        a.architecture,
        a.uneven,
        loss,
    )
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
