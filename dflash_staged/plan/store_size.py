"""The store's size before anything is extracted: bytes a token and a whole epoch's bytes, from the
config's ``[target]`` (taps, last layer, top-k, dtype) and ``[extract] store_dtype``, for ``dflash plan``
and ``dflash data show``. Extract records the exact figure once it has loaded the target (the
manifest's ``bytes_per_token``; ``dflash status`` prints it)."""

from __future__ import annotations

from dflash_staged.config import Config
from dflash_staged.manifest.status import human_bytes
from dflash_staged.store import bytes_per_token


def store_line(cfg: Config, hidden_size: int, taps: int, tokens: int, per: str = "an epoch") -> str:
    """One line: bytes a token (what they hold) x ``tokens`` real tokens (``per``: what they are)."""
    t, fp8 = cfg.target, cfg.extract.store_dtype != "target"
    stored = taps + (1 if t.store_last_layer else 0)
    itemsize = 4 if t.dtype == "float32" else 2
    bpt = bytes_per_token(stored, hidden_size, itemsize, t.store_topk, cfg.extract.store_dtype)
    held = [f"{stored} layer(s) of {hidden_size} in " + ("FP8 with a scale each" if fp8 else f"{itemsize} B")]
    held += [f"the target's top-{t.store_topk}"] if t.store_topk else []
    auto = " (target dtype auto: bfloat16 on CUDA, 4 B on a CPU)" if t.dtype == "auto" and not fp8 else ""
    return (
        f"store: {bpt:,} B a token ({', '.join(held)}){auto} x {tokens:,} real tokens = "
        f"{human_bytes(bpt * tokens)} {per} (extract.window_bytes caps what is on disk at once)"
    )
