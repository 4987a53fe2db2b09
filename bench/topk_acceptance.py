"""How far DSpark's acceptance label from a top-k store is from the reference's (issue 48, item 4).

The reference labels each proposal row with ``sum min(p, q)`` over the target's full distribution. From
a top-k store only the k ids' probabilities and the tail's mass ``r`` are known; this bench takes a
trained DSpark drafter and a store with the target's last layer, recomputes the full distribution, forms
the top-k from it as extract does (``Target.topk_of``'s arithmetic) and compares, over the same rows and
with the same position weights, the true label with what each rule gives:

* ``bound``: ``sum_top min(p, q) + min(r, sum_tail min(q_i, p_k))`` (the tightest upper bound the
  store gives),
* ``bucketed``: ``sum_top min(p, q) + min(r, q_rest)`` (the tail as one outcome),
* ``ids_only``: ``sum_top min(p, q)`` (a lower bound),
* ``midpoint``: halfway between ``ids_only`` and ``bound`` (the trainer's rule).

It reports each rule's mean signed error and mean absolute error per k, and the L1 term's bucketed value
against the full one. ``.venv/bin/python bench/topk_acceptance.py --manifest M --store S --drafter RUN``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def rules(p_full: torch.Tensor, q: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Each rule's label per row, the true one, and the L1 (full and bucketed)."""
    from dflash_staged.model.drafters.distill_head import acceptance, overlap_parts
    from dflash_staged.model.drafters.target_dist import TopK, topk_logp

    lp = p_full.log()
    v, ids = lp.topk(k, -1)
    top = TopK(ids, v.half(), torch.logsumexp(lp.scatter(1, ids, float("-inf")), -1))
    pt = topk_logp(q.log(), top).exp()
    on_ids, bound = overlap_parts(pt, q, top)
    q_rest = q.sum(-1) - q.gather(1, ids).sum(-1)
    r = top.logtail.exp()
    return {
        "true": torch.minimum(p_full, q).sum(-1),
        "bound": on_ids + bound,
        "bucketed": on_ids + torch.minimum(r, q_rest),
        "ids_only": on_ids,
        "midpoint": acceptance(pt, q, top),  # the trainer's rule
        "l1_full": (p_full - q).abs().sum(-1),
        "l1_bucketed": (pt - q).abs().sum(-1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", type=Path, required=True)
    ap.add_argument("--store", type=Path, required=True, help="a store with the target's last layer")
    ap.add_argument("--drafter", type=Path, required=True, help="a DSpark run directory or checkpoint")
    ap.add_argument("--shards", type=int, default=24)
    ap.add_argument("--ks", default="16,64")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "topk_acceptance.json")
    a = ap.parse_args()
    from dflash_staged.manifest import Manifest
    from dflash_staged.model.drafters.family import FamilyBatch
    from dflash_staged.model.drafters.weights import load_drafter
    from dflash_staged.model.target.weights import load_embed_and_head, load_final_norm
    from dflash_staged.store import ShardStore
    from dflash_staged.train.checkpoint import resolve_checkpoint
    from dflash_staged.train.objective import sample_anchors
    from dflash_staged.train.objective.loss import split_hidden

    with Manifest.open(a.manifest, readonly=True) as m:
        cfg, jobs = m.config, [j for j in m.jobs() if j.state in ("written", "kept")]
    store = ShardStore.open(a.store)
    if store.meta.last_layer is None:
        raise SystemExit(f"{a.store}: needs a store with the target's last layer")
    embed, head = load_embed_and_head(cfg.target)
    d = load_drafter(resolve_checkpoint(a.drafter, "--drafter"), embed, head).eval()
    if d.family.name != "dspark":
        raise SystemExit(f"{a.drafter}: a DSpark drafter, not {d.family.name}")
    norm = load_final_norm(cfg.target)
    ks = [int(x) for x in a.ks.split(",")]
    sums: dict[int, dict[str, list]] = {k: {} for k in ks}
    g = torch.Generator().manual_seed(0)
    captured: dict[str, torch.Tensor] = {}

    import dflash_staged.model.drafters.distill_head as dh

    real = dh.acceptance

    def spy(p, q, top):  # the rows' own q and full p, as the objective forms them
        captured["p"], captured["q"] = p, q
        return real(p, q, top)

    dh.acceptance = spy
    for j in jobs[: a.shards]:
        shard = store.read_shard(j.epoch, j.id, j.checksum)
        taps, last = split_hidden(d, shard.hidden.float())
        cu, mask = shard.cu_seqlens, shard.loss_mask
        anchors = sample_anchors(mask, cu, d.block_size, cfg.train.num_anchors, g)
        fb = FamilyBatch(
            d, taps, shard.input_ids.long(), mask, cu, anchors, last, norm, "sdpa", 0, 0, 10**9, g,
            cfg.train.gamma, None,
        )  # fmt: skip
        with torch.no_grad():
            _, rows = d.family.objective(fb)
        valid = rows.valid.reshape(-1)
        p, q = captured["p"][valid].double(), captured["q"][valid].double()
        for k in ks:
            for name, v in rules(p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True), k).items():
                sums[k].setdefault(name, []).append(v)
    dh.acceptance = real
    report = {"drafter": str(a.drafter), "shards": min(a.shards, len(jobs)), "by_k": {}}
    for k in ks:
        cat = {n: torch.cat(v) for n, v in sums[k].items()}
        true = cat["true"]
        rep = {"rows": int(true.numel()), "true_mean": round(float(true.mean()), 4)}
        for name in ("bound", "bucketed", "ids_only", "midpoint"):
            err = cat[name] - true
            rep[name] = {
                "mean_error": round(float(err.mean()), 4),
                "mean_abs_error": round(float(err.abs().mean()), 4),
            }
        rep["l1_full_mean"] = round(float(cat["l1_full"].mean()), 4)
        rep["l1_bucketed_mean"] = round(float(cat["l1_bucketed"].mean()), 4)
        report["by_k"][str(k)] = rep
        print(f"k={k}: {json.dumps(rep)}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
