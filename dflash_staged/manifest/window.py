"""The window's arithmetic: how many shards extract may hold against what the trainer needs.

The window (:mod:`dflash_staged.manifest.states`) bounds the shards claimed, written or consumed
but not released. Too small a window and the trainer waits forever for ``train.min_ready``
shards per rank that extract may not write; too small for the trainer's buffer, the shards of
one checkpoint interval and a few in flight per worker, and the target workers idle.
"""

from __future__ import annotations

from dflash_staged.config import Config


def window_check(cfg: Config, window: int, workers: int, ranks: int) -> tuple[str | None, str | None]:
    """(error, warning) about window W against the trainer: N = min_ready, C = capacity."""
    t = cfg.train
    n_need = t.min_ready * ranks
    per_ckpt = t.checkpoint_every * t.grad_accum * ranks
    comfortable = t.buffer_capacity * ranks + 3 * workers + per_ckpt
    if window < n_need:
        return (f"window {window} < train.min_ready {t.min_ready} x {ranks} rank(s) = {n_need}: the trainer "
                f"would wait forever for shards the extractor may not write. Raise --window to at least "
                f"{n_need} (comfortable: {comfortable}), or lower train.min_ready"), None
    if window < comfortable:
        return None, (f"window {window} < buffer capacity {t.buffer_capacity} x {ranks} rank(s) + 3 x {workers} "
                      f"worker(s) + {per_ckpt} shards consumed per checkpoint interval "
                      f"({t.checkpoint_every} steps x {t.grad_accum} x {ranks}) = {comfortable}: target workers "
                      "may idle while the trainer holds shards; raise --window to keep them busy")
    return None, None
