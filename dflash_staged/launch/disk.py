"""Disk arithmetic of a node layout: bytes per token, store bandwidth, window disk.

A token costs ``K x H x itemsize`` bytes of tapped hidden states (``K x (H + 4)`` in FP8,
``[extract] store_dtype``) plus 5 bytes (int32 id + uint8 loss mask), and 6 bytes an entry of the
target's top-k when stored, with 4 bytes for its tail. Every byte is written once by extract and
read once by train, so the store must sustain ``2 x tok/s per worker x extract workers x
bytes/token``, where a worker is one GPU, or with ``--tp N`` a group of N GPUs (extract GPUs / N
workers, each with its group's rate). The disk a window needs is ``window shards x real tokens per
job x bytes/token``.
"""

from __future__ import annotations

from pathlib import Path

from dflash_staged.store import bytes_per_token

# Hidden sizes of the recipe targets, for the disk arithmetic when the model is not on local disk.
KNOWN_HIDDEN = {
    "Qwen/Qwen3-8B": 4096,
    "Qwen/Qwen3.5-27B": 5120,
    "Qwen/Qwen3.6-35B-A3B": 2048,
    "Qwen/Qwen3.5-122B-A10B": 3072,
}


def target_hidden_size(model: str, override: int | None = None) -> int | None:
    """The target's hidden size without downloading: override, local or cached config, or the
    recipe table; None when unknown."""
    if override:
        return override
    from dflash_staged.config import TargetConfig
    from dflash_staged.errors import DflashError
    from dflash_staged.model.target.dims import target_dims

    try:
        return target_dims(TargetConfig(model=model), local_only=True).hidden_size
    except DflashError:
        return KNOWN_HIDDEN.get(model)


def _si(n: float) -> str:
    """Decimal units, as disk vendors quote bandwidth: 2.62 GB, 310 MB."""
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.3g} {unit}"
    return f"{n:.0f} B"


def _workers(n_gpus: int, tp: int) -> str:
    if tp == 1:
        return f"{n_gpus} worker(s) (one per extract GPU)"
    return f"{n_gpus // tp} worker(s) ({n_gpus} extract GPUs in tensor-parallel groups of {tp})"


def disk_requirements(
    config: Path,
    n_gpus: int,
    tok_s_per_worker: float,
    hidden_override: int | None,
    manifest: Path | str | None,
    window: int | None,
    itemsize: int | None = None,
    tp: int = 1,
) -> tuple[dict, list[str]]:
    """Bytes/token, write + read bandwidth and window disk of a node layout: (numbers, printable lines).
    `n_gpus` extract GPUs make `n_gpus // tp` workers of `tok_s_per_worker` each. `itemsize` defaults
    to the target dtype on CUDA (auto = bfloat16: 2 bytes)."""
    from dflash_staged.config import load_config

    cfg = load_config(config)
    itemsize = itemsize or {"float32": 4}.get(cfg.target.dtype, 2)
    layer_ids, avg_tokens, exact = None, float(cfg.data.token_budget), False
    from dflash_staged.manifest import Manifest

    if manifest is not None and Manifest.exists(manifest):
        with Manifest.open(manifest, readonly=True) as m:
            layer_ids = m.meta.get("layer_ids")
            avg_tokens = m.meta["tokens_real"] / max(1, m.meta["n_batches"])
            exact = True
    taps = len(layer_ids or cfg.target.target_layer_ids) or cfg.drafter.num_hidden_layers
    last = 1 if cfg.target.store_last_layer else 0  # the target's last layer, stored beside the taps
    k = taps + last
    hidden = target_hidden_size(cfg.target.model, hidden_override)
    window = window if window is not None else cfg.extract.window
    workers = n_gpus // tp
    d = {
        "k": k,
        "hidden": hidden,
        "itemsize": itemsize,
        "extract_gpus": n_gpus,
        "tp": tp,
        "extract_workers": workers,
        "tok_s_per_worker": tok_s_per_worker,
        "window": window,
        "avg_tokens_per_job": avg_tokens,
        "avg_exact": exact,
    }
    if hidden is None:
        return d, [
            f"disk: hidden size of {cfg.target.model!r} unknown offline; pass --hidden-size H for the "
            "bandwidth and window arithmetic"
        ]
    topk = cfg.target.store_topk
    fp8 = cfg.extract.store_dtype != "target"
    bpt = bytes_per_token(k, hidden, itemsize, topk, cfg.extract.store_dtype)
    write = tok_s_per_worker * workers * bpt
    win = window * avg_tokens * bpt
    d.update(bytes_per_token=bpt, write_Bps=write, store_Bps=2 * write, window_bytes=win)
    lines = [
        f"bytes per token: K={k} stored layers ({taps} tapped{' + the last' if last else ''}) x "
        + (f"(hidden {hidden} x 1 B FP8 + a 4 B scale)" if fp8 else f"hidden {hidden} x {itemsize} B")
        + (
            f" + the target's top-{topk} ({topk} x 6 B: int32 id, fp16 log-probability; 4 B tail)"
            * bool(topk)
        )
        + f" + 5 B (id, loss mask) = {bpt:,} B",
        f"disk bandwidth: {tok_s_per_worker:,.0f} tok/s per extract worker (--target-tok-s, or what "
        f"--split auto measured) x {_workers(n_gpus, tp)}"
        f" x {bpt:,} B = {_si(write)}/s written; each byte is read once by train, so the store must sustain "
        f"{_si(2 * write)}/s (write + read)",
        f"window disk: {window} shards x {avg_tokens:,.0f} real tokens per job "
        f"({'plan average' if exact else 'upper bound: data.token_budget; exact after planning'}) x {bpt:,} "
        f"B "
        f"= {_si(win)} (extract.window_bytes / --window-bytes caps it)",
    ]
    return d, lines
