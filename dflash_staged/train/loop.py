"""``dflash train``: tail the manifest, draw length-mixed steps, checkpoint, release shards.

The loop (:func:`train_loop`) reads top to bottom: gather a step's shards,
forward/backward each microbatch, all-reduce, optimizer step, mark the shards
consumed, log, and periodically checkpoint + release. Setup, resume and the
shard source live in :mod:`dflash_staged.trainer_setup`.

Consumption contract (see also :mod:`dflash_staged.manifest`):

* a shard is ``consumed`` when the optimizer step that used it completes;
* it is deleted and ``released`` (or ``kept`` with ``--keep-shards``) only after
  a durable checkpoint covers that step;
* the trainer never waits for shards while it holds consumed, unreleased ones:
  it checkpoints and releases first, which frees the extractor's window;
* on resume, the checkpoint's per-step job list decides what happened: listed
  jobs are consumed, every other consumed job returns to ``written``.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field

from dflash_staged.store import ShardError

WAIT_POLL_S = 0.25


@dataclass
class StepData:
    """What one optimizer step consumed on this rank."""
    shards: list = field(default_factory=list)  # (job, shard)
    wait_s: float = 0.0
    bucket_choices: int = 0  # distinct buckets in the buffer when the step was drawn


def microbatches(shard, max_tokens: int) -> list[dict]:
    """Split a shard's packed sequences into groups of at most max_tokens (a longer sequence is alone)."""
    cu = shard.cu_seqlens.tolist()
    groups, start = [], 0
    for i in range(1, len(cu)):
        if cu[i] - cu[start] > max_tokens and i - 1 > start:
            groups.append((start, i - 1))
            start = i - 1
    groups.append((start, len(cu) - 1))
    out = []
    for s, e in groups:
        a, b = cu[s], cu[e]
        out.append({"hidden": shard.hidden[a:b], "input_ids": shard.input_ids[a:b].long(),
                    "loss_mask": shard.loss_mask[a:b], "cu_seqlens": shard.cu_seqlens[s:e + 1] - a})
    return out


def lr_at(step: int, total: int, base: float, warmup_ratio: float) -> float:
    """Linear warmup then cosine decay to zero; `step` counts completed steps (0-based)."""
    warm = max(1, int(round(warmup_ratio * total)))
    if step < warm:
        return base * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return base * 0.5 * (1 + math.cos(math.pi * progress))


class StopRequested:
    """SIGINT/SIGTERM set a flag; the loop checkpoints at the next step boundary and exits."""

    def __init__(self):
        self.signum = 0
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._handler)

    def _handler(self, signum, _frame):
        self.signum = signum

    def __bool__(self) -> bool:
        return bool(self.signum)


def gather_step(run, stop) -> StepData | None:
    """Draw this step's shards (distinct shards, preferring distinct buckets); wait while fewer
    than min_ready are ready and extraction is not finished. None once everything is drained."""
    data = StepData()
    t0 = time.perf_counter()
    waited = False
    while True:
        run.source.fill(run.buffer)
        if len(run.buffer) >= run.cfg.train.min_ready or run.source.finished():
            break
        if stop:
            return None
        if run.holds_unreleased() and not run.dist.enabled:
            run.checkpoint_and_release()  # frees the window before waiting (DDP: see train_loop)
        run.source.check_progress_possible()
        run.progress.waiting(len(run.buffer), run.cfg.train.min_ready)
        waited = True
        time.sleep(WAIT_POLL_S)
    if waited:
        data.wait_s += time.perf_counter() - t0
    buckets: set[int] = set()
    data.bucket_choices = len({e.bucket for e in run.buffer.entries})
    for forced in run.source.forced_step(run.step):
        shard, w = run.buffer.load(forced)
        data.wait_s += w
        data.shards.append((forced.job, shard))
    while len(data.shards) < run.cfg.train.grad_accum and len(run.buffer):
        entry = run.buffer.draw(buckets, run.draw_gen, prefer_read=run.source.live)
        try:
            shard, w = run.buffer.load(entry)
        except ShardError as e:
            run.source.bad_shard(entry.job, e)
            run.source.fill(run.buffer)
            continue
        data.wait_s += w
        buckets.add(entry.job.bucket)
        data.shards.append((entry.job, shard))
    return data


def train_loop(run) -> int:
    """The training loop. `run` is a :class:`dflash_staged.trainer_setup.Run` (model, data, state)."""
    cfg, dist = run.cfg, run.dist
    stop = StopRequested()
    stopping = False
    while not (run.opts.max_steps and run.step >= run.opts.max_steps):
        # ---- data: this step's shards (may wait; never while holding unreleased shards) --------------
        if run.dist.enabled and run.holds_unreleased() and run.dist.any(run.would_wait()):
            run.checkpoint_and_release()  # collective, so every rank releases before any waits
        data = gather_step(run, stop)
        local_jobs = [] if data is None else data.shards
        if not dist.any(len(local_jobs) > 0):
            if stop or not dist.any(not run.source.finished()):
                break  # drained (or stopping)
            continue  # every shard drawn failed verification and went back to extract: wait for more
        t_step = time.perf_counter()

        # ---- forward / backward over every microbatch of every shard ------------------------------
        mbs = [mb for _, shard in local_jobs for mb in microbatches(shard, cfg.train.microbatch_tokens)]
        n_total = dist.sum_int(len(mbs))
        noise = run.noise_std()
        stats = run.zero_stats()
        for mb in mbs:
            mb = {k: v.to(run.device, non_blocking=True) for k, v in mb.items()}
            with run.autocast():
                loss, st = run.loss_fn(mb, noise)
            (loss / n_total).backward()
            run.add_stats(stats, st)

        # ---- optimizer step (gradients summed over ranks) -----------------------------------------
        lr = lr_at(run.step, run.total_steps, cfg.train.lr, cfg.train.warmup_ratio)
        run.optimizer_step(lr)
        run.step += 1
        jobs = dist.gather_jobs([(job.id, dist.rank, int(shard.input_ids.numel()), job.bucket,
                                  float(shard.input_ids.numel()) / max(1, shard.cu_seqlens.numel() - 1))
                                 for job, shard in local_jobs])
        run.mark_consumed(jobs)
        step_s = time.perf_counter() - t_step

        # ---- log --------------------------------------------------------------------------------
        run.log_step(jobs, stats, lr, data.wait_s if data else 0.0, step_s,
                     dist.sum_int(data.bucket_choices if data else 0))

        # ---- checkpoint + release shards the checkpoint covers ------------------------------------
        stopping = dist.any(bool(stop))  # every rank agrees, since checkpointing is collective
        if run.step % cfg.train.checkpoint_every == 0 or stopping:
            run.checkpoint_and_release()
        if stopping:
            break
    # ---- the end: final checkpoint, release, report -------------------------------------------------
    stopping = dist.any(bool(stop))
    run.checkpoint_and_release()
    run.progress.close()
    if stopping:
        return 128 + (stop.signum or signal.SIGTERM)
    return run.source.final_status()
