"""The window's rule: how many shards (and bytes) extract may hold against what the trainer needs.

The window (:mod:`dflash_staged.manifest.states`) bounds the shards claimed, written or consumed
but not released. Extract checks this rule before it starts and the trainer checks it again
against the settings extract published (:class:`WindowSettings`, ``extract_window`` in the
manifest's metadata).

**Refused** (it can deadlock): a window that cannot hold every rank's full buffer, in shards
(``window < train.buffer_capacity x ranks``) or in bytes (``window_bytes < buffer_capacity x
ranks x the largest shard``). Why that bound suffices: a trainer rank waits only while its
buffer is not full (it waits for ``train.min_ready`` shards, or for a second length bucket when
a step takes several jobs), and it never waits on a full window holding consumed, unreleased
shards (it checkpoints and releases them as soon as it sees the window full, and after a few
seconds of waiting in any case; a released batch leaves the window once its files are deleted, so
the store's bytes never exceed what the window counts). So while every rank waits on a full
window, the window holds claims in flight and fewer than ``capacity x ranks`` written shards;
claims always publish, so room for one more claim appears, and extraction goes on until some
buffer fills or nothing is left to extract.
Below that bound every shard in the window can be of one length bucket, or sit in one rank's
buffer, and both sides wait forever.

**Warned** (target workers may idle): below ``capacity x ranks + 3 x workers + the shards one
checkpoint interval consumes``, the message says by how many shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dflash_staged.config import Config
from dflash_staged.manifest.status import human_bytes as _size


def window_check(
    cfg: Config, window: int, workers: int, ranks: int, *, window_bytes: int = 0, shard_bytes_max: int = 0
) -> tuple[str | None, str | None]:
    """(error, warning) about a window of ``window`` shards (and ``window_bytes`` bytes, 0 = no
    byte limit; checked when the largest shard's bytes are known) against ``ranks`` trainer ranks."""
    t = cfg.train
    need = t.buffer_capacity * ranks
    per_ckpt = t.checkpoint_every * t.grad_accum * ranks
    comfortable = need + 3 * workers + per_ckpt
    if window < need:
        return (
            f"--window {window} < train.buffer_capacity {t.buffer_capacity} x {ranks} trainer rank(s) = "
            f"{need}: when the window's shards are all of one length bucket the trainer waits for more "
            f"while extract waits for room, forever. Raise --window to at least {need} (comfortable: "
            f"{comfortable}), or lower train.buffer_capacity"
        ), None
    if window_bytes and shard_bytes_max:
        need_b = need * shard_bytes_max
        if window_bytes < need_b:
            return (
                f"--window-bytes {_size(window_bytes)} < train.buffer_capacity {t.buffer_capacity} x "
                f"{ranks} trainer rank(s) x {_size(shard_bytes_max)} (the largest shard) = "
                f"{_size(need_b)}: extract would stop claiming before the trainer's buffers can fill, "
                f"and both would wait forever. Raise --window-bytes to at least {need_b} "
                f"({_size(need_b)}), lower train.buffer_capacity, or plan smaller jobs (data.token_budget)"
            ), None
    if window < comfortable:
        return None, (
            f"window {window} is {comfortable - window} shard(s) short of buffer capacity "
            f"{t.buffer_capacity} x {ranks} rank(s) + 3 x {workers} worker(s) + {per_ckpt} "
            f"shards consumed per checkpoint interval ({t.checkpoint_every} steps x "
            f"{t.grad_accum} x {ranks}) = {comfortable}: target workers may idle while the "
            "trainer holds shards; raise --window to keep them busy"
        )
    return None, None


@dataclass(frozen=True)
class WindowSettings:
    """The window extract runs with, published in the manifest's metadata under :attr:`KEY` for the
    trainer to check the rule against. Stored as ``{"shards", "bytes", "workers", "shard_bytes_max"}``
    (:meth:`to_meta`); a manifest without it (no extract started yet) reads as the config's window,
    one worker and no byte limit (:meth:`from_meta`)."""

    KEY: ClassVar[str] = "extract_window"

    shards: int
    window_bytes: int = 0  # 0 = no byte limit
    workers: int = 1  # extract workers (one per device, or per tensor-parallel group)
    shard_bytes_max: int = 0  # the plan's largest shard in bytes; 0 = unknown (the byte rule is not checked)

    def to_meta(self) -> dict:
        return {
            "shards": self.shards,
            "bytes": self.window_bytes,
            "workers": self.workers,
            "shard_bytes_max": self.shard_bytes_max,
        }

    @classmethod
    def from_meta(cls, meta: dict | None, fallback_shards: int) -> WindowSettings:
        """The published settings, or (``meta`` empty) a window of ``fallback_shards`` shards."""
        if not meta:
            return cls(shards=int(fallback_shards))
        return cls(
            shards=int(meta["shards"]),
            window_bytes=int(meta.get("bytes") or 0),
            workers=int(meta.get("workers") or 1),
            shard_bytes_max=int(meta.get("shard_bytes_max") or 0),
        )

    def check(self, cfg: Config, ranks: int) -> tuple[str | None, str | None]:
        """:func:`window_check` of these settings against ``ranks`` trainer ranks."""
        return window_check(
            cfg,
            self.shards,
            self.workers,
            ranks,
            window_bytes=self.window_bytes,
            shard_bytes_max=self.shard_bytes_max,
        )
