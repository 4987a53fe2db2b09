"""``dflash train``: the training loop, top to bottom.

Each step: gather this step's shards (waiting while fewer than ``train.min_ready`` are ready, or
all from one length bucket, never while holding consumed, unreleased shards), forward/backward every microbatch (each
backpropagates its weighted loss sum), sum the gradients over ranks and divide them by the
step's total loss weight over all ranks, take the optimizer step, record the shards as consumed, log, and every
``train.checkpoint_every`` steps checkpoint and release. The consumption, release and resume
rules are :mod:`dflash_staged.train.ledger`'s; the components come from
:func:`dflash_staged.train.trainer.build_trainer`.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

from dflash_staged.store import ShardError
from dflash_staged.train.objective import per_offset_accuracy, training_tau
from dflash_staged.train.trainer import Trainer

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


def gather_step(t: Trainer, stop) -> StepData | None:
    """Draw this step's shards (distinct shards, preferring distinct buckets); wait while the
    buffer is not ready (:meth:`Trainer.ready`). None once everything is drained."""
    data = StepData()
    t0 = time.perf_counter()
    waited = False
    while True:
        t.source.fill(t.buffer)
        if t.ready():
            break
        if stop:
            return None
        if t.ledger.holds_unreleased(t.step) and not t.dist.enabled:
            t.checkpoint_and_release()  # frees the window before waiting (DDP: see train_loop)
        t.source.check_progress_possible()
        t.progress.waiting(len(t.buffer), t.cfg.train.min_ready, one_bucket=len(t.buffer) >= t.cfg.train.min_ready)
        waited = True
        time.sleep(WAIT_POLL_S)
    if waited:
        data.wait_s += time.perf_counter() - t0
    buckets: set[int] = set()
    data.bucket_choices = len({e.bucket for e in t.buffer.entries})
    for forced in t.source.forced_step(t.step):
        shard, w = t.buffer.load(forced)
        data.wait_s += w
        data.shards.append((forced.job, shard))
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


def forward_backward(model, mbs: list[dict], device, noise: float) -> dict:
    """Backpropagate every microbatch's weighted loss sum (gradients accumulate); the summed stats."""
    stats = model.zero_stats()
    for mb in mbs:
        loss_sum, st = model.loss({k: v.to(device, non_blocking=True) for k, v in mb.items()}, noise)
        loss_sum.backward()
        model.add_stats(stats, st)
    return stats


def metrics_line(t: Trainer, jobs: list, stats: dict, lr: float, data: StepData | None, step_s: float) -> dict:
    """This step's metrics line (loss and accuracies synchronise the host: every step on CPU,
    every ``train.log_every`` steps on CUDA)."""
    loss = acc = tau = None
    if t.device.type != "cuda" or t.step % t.cfg.train.log_every == 0:
        vals = [stats["correct"], stats["total"]] + [stats[k].reshape(1) for k in
                                                     ("loss_sum", "weight_sum", "accepted", "blocks")]
        t.dist.all_reduce_(vals)
        loss = float(stats["loss_sum"] / stats["weight_sum"].clamp_min(1e-12))
        acc = per_offset_accuracy(stats["correct"], stats["total"])
        tau = training_tau(stats["accepted"], stats["blocks"])
    choices = t.dist.sum_int(data.bucket_choices if data else 0)
    return {"step": t.step, "loss": loss, "lr": lr, "acc": acc, "tau": tau, "tokens": sum(j[2] for j in jobs),
            "jobs": [j[0] for j in jobs], "ranks": [j[1] for j in jobs], "buckets": [j[3] for j in jobs],
            "lengths": [round(j[4], 1) for j in jobs], "data_wait_s": round(data.wait_s if data else 0.0, 4),
            "step_s": round(step_s, 4), "buffer": len(t.buffer), "bucket_choices": choices}


def train_loop(t: Trainer) -> int:
    """The training loop; returns the exit code."""
    cfg, dist = t.cfg, t.dist
    stop = StopRequested()
    while not (t.opts.max_steps and t.step >= t.opts.max_steps):
        # ---- data: this step's shards (may wait; never while holding unreleased shards) --------------
        if dist.enabled and t.ledger.holds_unreleased(t.step) and dist.any(t.would_wait()):
            t.checkpoint_and_release()  # collective, so every rank releases before any waits
        data = gather_step(t, stop)
        local = [] if data is None else data.shards
        if not dist.any(len(local) > 0):
            if stop or not dist.any(not t.source.finished()):
                break  # drained (or stopping)
            continue  # every shard drawn failed verification and went back to extract: wait for more
        t_step = time.perf_counter()

        # ---- forward / backward over every microbatch of every shard ------------------------------
        mbs = [mb for _, shard in local for mb in microbatches(shard, cfg.train.microbatch_tokens)]
        stats = forward_backward(t.model, mbs, t.device, t.model.noise_std(t.step, t.total_steps))

        # ---- optimizer step (gradients summed over ranks / the step's total loss weight), consume ----
        lr = t.optim.lr(t.step, t.total_steps)
        t.optim.step(lr, stats["weight_sum"])
        t.step += 1
        jobs = dist.gather_jobs([(job.id, dist.rank, int(shard.input_ids.numel()), job.bucket,
                                  float(shard.input_ids.numel()) / max(1, shard.cu_seqlens.numel() - 1))
                                 for job, shard in local])
        t.ledger.record(t.step, jobs)
        step_s = time.perf_counter() - t_step

        # ---- log --------------------------------------------------------------------------------
        line = metrics_line(t, jobs, stats, lr, data, step_s)
        t.metrics.write(line)
        t.progress.step(t.step, line["loss"], line["tokens"] / max(step_s, 1e-9), len(t.buffer), t.buffer.capacity)

        # ---- checkpoint + release shards the checkpoint covers ------------------------------------
        stopping = dist.any(bool(stop))  # every rank agrees, since checkpointing is collective
        if t.step % cfg.train.checkpoint_every == 0 or stopping:
            t.checkpoint_and_release()
        if stopping:
            break
    # ---- the end: final checkpoint, release, report -------------------------------------------------
    stopping = dist.any(bool(stop))
    t.checkpoint_and_release()
    if stopping:
        return 128 + (stop.signum or signal.SIGTERM)
    return t.source.final_status()
