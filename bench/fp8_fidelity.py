"""What FP8 storage does to the states and to the target's distribution recomputed from its stored last
layer (issue 43: whether the last layer may follow ``[extract] store_dtype``).

Reads ``--shards`` shards of a kept store that holds the last layer at full precision, quantizes every
stored layer as an FP8 store would (:mod:`dflash_staged.store.fp8`), and reports per layer the relative
error ``||x^ - x|| / ||x||``, and for the last layer the target's distribution through its final norm
and head from both: total variation, the argmax agreeing, and the KL divergence. The baseline is the
full-precision state, measured in the same run.

    .venv/bin/python bench/fp8_fidelity.py --manifest M --store S --config configs/smollm2-demo.toml
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_staged.config import load_config  # noqa: E402
from dflash_staged.manifest import Manifest  # noqa: E402
from dflash_staged.model.target.logits import log_probs  # noqa: E402
from dflash_staged.store import ShardStore  # noqa: E402
from dflash_staged.store.fp8 import dequantize, quantize  # noqa: E402


def head_of(cfg):
    """The target's final norm and LM head (float32, CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.target.model, dtype=torch.float32)
    return model.model.norm.eval(), model.lm_head.weight.detach()


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", type=Path, required=True)
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-demo.toml")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    store = ShardStore.open(a.store)
    if store.meta.last_layer is None or store.meta.fp8:
        raise SystemExit(f"{a.store}: needs a full-precision store with the last layer")
    with Manifest.open(a.manifest, readonly=True) as m:
        jobs = [j for j in m.jobs() if j.state in ("written", "kept")][: a.shards]
    norm, W = head_of(load_config(a.config))
    K = store.meta.stored_layers
    rel = torch.zeros(K, dtype=torch.float64)
    tv = kl = agree = n = 0.0
    for j in jobs:
        x = store.read_shard(j.epoch, j.id, j.checksum).hidden.float()  # [T, K, H]
        y = dequantize(*quantize(x), torch.float32)
        rel += ((y - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)).double().sum(0)
        for s in range(0, x.shape[0], 256):
            p = log_probs(norm(x[s : s + 256, -1]) @ W.t())
            q = log_probs(norm(y[s : s + 256, -1]) @ W.t())
            tv += 0.5 * float((p.exp() - q.exp()).abs().sum())
            kl += float((p.exp() * (p - q)).sum())
            agree += float((p.argmax(-1) == q.argmax(-1)).sum())
        n += x.shape[0]
    out = {
        "store": str(a.store),
        "logical_dtype": store.meta.logical_dtype,
        "tokens": int(n),
        "rel_error_per_layer": [round(float(v) / n, 5) for v in rel],
        "layers": store.meta.layer_ids + [store.meta.last_layer],
        "last_layer_target_tv": tv / n,
        "last_layer_target_kl": kl / n,
        "last_layer_argmax_agree": agree / n,
    }
    print(json.dumps(out, indent=1))
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
