"""The drawing policy: when a step may be drawn, what it takes, and what happens while it waits.

One rank and many alike (every decision below is collective, so ranks never disagree about
waiting, and none sits in a gradient all-reduce while another waits for shards):

* **ready**: every rank's buffer holds ``train.min_ready`` shards, from two or more length buckets
  when a step takes several jobs (``train.grad_accum >= 2``); a rank whose buffer is full, or
  whose source will deliver nothing more, counts as ready (never wait on what cannot arrive).
  The window rule (:mod:`dflash_staged.manifest.window`) makes sure a buffer can always fill.
* **waiting**: while any rank is not ready, all ranks poll together, every 8 ms at first and
  backing off to :data:`WAIT_POLL_S` (a shard that is nearly there costs a short wait). A rank
  that holds consumed shards no checkpoint covers yet checkpoints and releases them (which frees
  extract's window) as soon as extract's window is full (:func:`window_full`: it could otherwise
  wait for the trainer forever) or the wait has lasted :data:`CHECKPOINT_AFTER_S`; a short wait
  with room in the window costs no checkpoint. After the first quarter second, a rank that finds
  progress impossible (jobs pending but no extract running) stops every rank with the same
  message. Every decision counts polls, never clocks, so ranks agree.
* **drawing**: forced jobs first (a replay's recorded order), then uniformly at random from the
  buffer, preferring length buckets not yet in the step (:meth:`ShardBuffer.draw`). A shard that
  fails verification goes back to extract and the draw goes on without waiting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dflash_staged.errors import DflashError
from dflash_staged.manifest.window import WindowSettings
from dflash_staged.store import ShardError

WAIT_POLL_S = 0.25  # the longest pause between polls; the first is WAIT_POLL_S / 2**WAIT_BACKOFFS
WAIT_BACKOFFS = 5
CHECKPOINT_AFTER_S = 5.0  # a wait this long (in scheduled pauses) checkpoints and releases anyway


@dataclass
class StepData:
    """What one optimizer step consumed on this rank."""

    shards: list = field(default_factory=list)  # (job, shard)
    wait_s: float = 0.0
    bucket_choices: int = 0  # distinct buckets in the buffer when the step was drawn


def ready(t) -> bool:
    """Whether this rank's buffer can give the next step its shards (see the module docstring)."""
    b = t.buffer
    if t.source.finished() or len(b) >= b.capacity:
        return True
    if len(b) < t.cfg.train.min_ready:
        return False
    return t.cfg.train.grad_accum < 2 or len({e.bucket for e in b.entries}) >= 2


def all_ready(t) -> bool:
    """Fill this rank's buffer, then whether every rank is ready (collective)."""
    t.source.fill(t.buffer)
    return not t.dist.any(not ready(t))


def raise_together(t, check) -> None:
    """Run ``check()`` on every rank; if it raised a DflashError on any, raise it on all (collective)."""
    err = None
    try:
        check()
    except DflashError as e:
        err = e
    errors = t.dist.gather_obj(None if err is None else (type(err), str(err)))
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        if err is not None:
            raise err
        kind, msg = first
        raise kind(msg) if issubclass(kind, DflashError) else DflashError(msg)


def window_full(t, s: WindowSettings) -> bool:
    """Whether extract's window (``s``: the settings it published) has no room for another claim."""
    w = t.m.window(t.ledger.node)  # node-local stores: this node's window
    return w["shards"] >= s.shards or bool(s.window_bytes and w["bytes"] >= s.window_bytes)


def published_window(t) -> WindowSettings:
    """The window extract published last (read afresh), else the run config's."""
    t.m.forget_meta()
    return WindowSettings.from_meta(t.m.meta.get(WindowSettings.KEY), t.cfg.extract.window)


def wait_pauses():
    """The pauses between polls while waiting: doubling up to WAIT_POLL_S, then WAIT_POLL_S."""
    for i in range(WAIT_BACKOFFS, 0, -1):
        yield WAIT_POLL_S / 2**i
    while True:
        yield WAIT_POLL_S


def gather_step(t, stop) -> StepData | None:
    """This step's shards on this rank, once every rank is ready; None on every rank alike once a stop
    was requested on any (agreed by a collective, so the caller may branch on it)."""
    data = StepData()
    t0 = time.perf_counter()
    waited, scheduled, pauses, window = False, 0.0, wait_pauses(), None
    while not all_ready(t):
        if t.dist.any(bool(stop)):
            return None
        if t.ledger.holds_unreleased(t.step):  # the same on every rank: the ledger is global
            if t.ledger.deletes and window is None:  # rank 0, or each node's first rank (node-local)
                window = published_window(t)
            if scheduled >= CHECKPOINT_AFTER_S or t.dist.any(t.ledger.deletes and window_full(t, window)):
                t.checkpoint_and_release()
        if scheduled >= WAIT_POLL_S:
            raise_together(t, t.source.check_progress_possible)
        t.ledger.poll()  # a batch whose files are gone is released: room in extract's window
        n, need = len(t.buffer), t.cfg.train.min_ready
        t.progress.waiting(n, need, one_bucket=n >= need)
        waited, pause = True, next(pauses)
        scheduled += pause
        time.sleep(pause)
    if waited:
        data.wait_s += time.perf_counter() - t0
    data.bucket_choices = len({e.bucket for e in t.buffer.entries})
    for forced in t.source.forced_step(t.step):
        shard, w = t.buffer.load(forced)
        data.wait_s += w
        data.shards.append((forced.job, shard))
    buckets: set[int] = set()
    while len(data.shards) < t.cfg.train.grad_accum and len(t.buffer):
        entry = t.buffer.draw(buckets, t.draw_gen, prefer_read=t.source.live)
        try:
            shard, w = t.buffer.load(entry)
        except ShardError as e:
            t.source.bad_shard(entry.job, e)
            t.source.fill(t.buffer)
            continue
        data.wait_s += w
        buckets.add(entry.job.bucket)
        data.shards.append((entry.job, shard))
    return data
