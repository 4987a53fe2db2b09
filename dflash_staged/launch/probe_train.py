"""One trainer rank's tokens/s on written shards, for ``dflash node --split auto``: run as
``python -m dflash_staged.launch.probe_train`` (a child of the launcher, on one device).

It builds the drafter from the manifest's config (with the run's ``--set`` overrides) as
``dflash train`` does, reads up to ``--shards`` written shards (verified; a damaged one is skipped and
named: the run's trainer sends it back to extract) read-only, and takes
optimizer steps through the training loop's own code (:func:`~dflash_staged.train.loop.shard_microbatches`,
:func:`~dflash_staged.train.loop.forward_backward`, the optimizer step): ``train.grad_accum``
shards a step, at the config's ``num_anchors``, ``microbatch_tokens``, block size and attention.
A first pass over the shards warms up (each padded shape compiles once), a second one is timed
(at least :data:`MIN_TIMED_STEPS` steps; on CUDA each step ends with a synchronize). It writes
nothing: no shard is taken, consumed or released, and no checkpoint or metrics file is written.
The last line of its output is ``probe-result {json}``: ``tok_s``, ``tokens``, ``seconds``,
``steps``, ``shards``, ``device``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

RESULT = "probe-result "
MIN_TIMED_STEPS = 2


def measure(manifest: str, store_dir: str, device: str | None, shards: int, sets: list[str]) -> dict:
    import torch

    from dflash_staged.config.overrides import parse_sets
    from dflash_staged.errors import DflashError
    from dflash_staged.manifest import Manifest
    from dflash_staged.manifest.layout import KEY as LAYOUT_KEY
    from dflash_staged.procs import HOST
    from dflash_staged.store import ShardError, ShardStore
    from dflash_staged.train import inputs
    from dflash_staged.train.buffer import pinned
    from dflash_staged.train.distributed import Dist
    from dflash_staged.train.loop import forward_backward, shard_microbatches
    from dflash_staged.train.optim import Optimizer
    from dflash_staged.train.options import TrainOptions
    from dflash_staged.train.trained_drafter import DrafterModel, build_drafter, target_norm_for

    dev = inputs.pick_device(device)
    with Manifest.open(manifest, readonly=True) as m:
        opts = TrainOptions(manifest=manifest, store=store_dir, out=None, overrides=parse_sets(sets))
        cfg = inputs.run_config(m, opts)
        vocab = m.meta.get("loss_tokens")
        store = ShardStore.open(store_dir, expect={"manifest_id": m.manifest_id})
        mine = HOST if m.meta.get(LAYOUT_KEY) == "node" else None  # node-local: only this node's store
        written = [j for j in m.jobs("written") if mine in (None, j.host)]
        candidates = sorted(written, key=lambda j: (j.epoch, j.pos))
    data = []
    for j in candidates:  # the first ``shards`` that read whole: a damaged one is the run's to re-extract
        if len(data) >= shards:
            break
        try:
            data.append(store.read_shard(j.epoch, j.id, j.checksum, True))
        except ShardError as e:
            print(f"skipping shard e{j.epoch}/j{j.id}: {e} (the run's trainer re-extracts it)", flush=True)
    if not data:
        raise DflashError(f"{manifest}: no written shard reads whole to time a trainer rank on")
    if dev.type == "cuda":
        data = [pinned(s) for s in data]
    norm = target_norm_for(cfg, store, dev)
    drafter = build_drafter(cfg, store, dev, draft_vocab=vocab)
    model = DrafterModel(
        drafter,
        cfg.train,
        dev,
        0,
        norm,
        store_topk=store.meta.topk,
        hidden_dtype=store.torch_dtype,
        fp8=store.meta.fp8,
    )
    optim = Optimizer(model.params, cfg.train, Dist(dev))
    t = SimpleNamespace(cfg=cfg, model=model)
    per_step = max(1, cfg.train.grad_accum)
    n_steps = max(MIN_TIMED_STEPS, -(-len(data) // per_step))
    total = 1000  # the schedule's length: only the learning rate's (and the loss knobs') values depend on it

    def step(i: int) -> tuple[int, float]:
        shards = [data[(i * per_step + k) % len(data)] for k in range(per_step)]
        t0 = time.perf_counter()
        mbs = [mb for s in shards for mb in shard_microbatches(t, s)]
        stats = forward_backward(model, mbs, dev, model.knobs(i, total))
        optim.step(optim.lr(i, total), stats["weight_sum"])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return sum(int(s.input_ids.numel()) for s in shards), time.perf_counter() - t0

    warm = [step(i) for i in range(-(-len(data) // per_step))]
    timed = [step(i) for i in range(n_steps)]
    tokens, seconds = sum(x[0] for x in timed), sum(x[1] for x in timed)
    return {
        "tok_s": tokens / max(seconds, 1e-9),
        "tokens": tokens,
        "seconds": seconds,
        "steps": len(timed),
        "warmup_steps": len(warm),
        "warmup_seconds": sum(x[1] for x in warm),
        "shards": len(data),
        "device": str(dev),
    }


def main(argv: list[str] | None = None) -> int:
    from dflash_staged.errors import DflashError

    ap = argparse.ArgumentParser(prog="python -m dflash_staged.launch.probe_train")
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--device", default=None)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    a = ap.parse_args(argv)
    try:
        result = measure(a.manifest, a.store, a.device, a.shards, a.sets)
    except DflashError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
