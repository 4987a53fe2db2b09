"""``dflash train``: the training loop, top to bottom.

Each step: gather this step's shards (:mod:`dflash_staged.train.draw`: the drawing and waiting
policy, the same for one rank and many), forward/backward every microbatch (each
backpropagates its weighted loss sum), sum the gradients over ranks and divide them by the
step's total loss weight over all ranks, take the optimizer step (not applied when the gradient is
not finite: the step is logged as ``skipped``, and :data:`NONFINITE_STOP` such steps in a row stop
the run with one line), record the shards as consumed, log, and every
``train.checkpoint_every`` steps checkpoint and release. The rank's seconds busy and waiting for
data are published with its registration (:class:`BusyIdle`, :mod:`dflash_staged.manifest.balance`).
The consumption, release and resume rules are :mod:`dflash_staged.train.ledger`'s; the components come from
:func:`dflash_staged.train.trainer.build_trainer`.
"""

from __future__ import annotations

import math
import signal
import sys
import time

import torch

from dflash_staged.errors import DflashError
from dflash_staged.manifest.balance import PUBLISH_S, SIDES, Tally
from dflash_staged.procs import my_identity
from dflash_staged.train.draw import StepData, gather_step
from dflash_staged.train.ledger import Consumed, token_digest
from dflash_staged.train.objective import (
    anchor_counts,
    per_offset_accuracy,
    selector_metrics,
    target_metrics,
    training_tau,
)
from dflash_staged.train.summary import signal_name
from dflash_staged.train.trainer import Trainer

NONFINITE_STOP = 8  # steps in a row whose loss or gradient is not finite (each skipped) stop the run


def microbatches(shard, max_tokens: int, max_rows: int = 0, rows: list[int] | None = None) -> list[dict]:
    """Split a shard's packed sequences, in order, into groups of at most ``max_tokens`` tokens and
    (when ``max_rows`` > 0) at most ``max_rows`` drafter rows, ``rows[i]`` being sequence i's; a
    sequence over either budget is alone."""
    cu = shard.cu_seqlens.tolist()
    n = len(cu) - 1
    rows = rows or [0] * n
    groups, start, held = [], 0, 0
    for i in range(n):
        held += rows[i]
        if i > start and (cu[i + 1] - cu[start] > max_tokens or (max_rows and held > max_rows)):
            groups.append((start, i))
            start, held = i, rows[i]
    groups.append((start, n))
    out = []
    topk = getattr(shard, "topk_ids", None) is not None
    for s, e in groups:
        a, b = cu[s], cu[e]
        mb = {
            "hidden": shard.hidden[a:b],
            "input_ids": shard.input_ids[a:b].long(),
            "loss_mask": shard.loss_mask[a:b],
            "cu_seqlens": shard.cu_seqlens[s : e + 1] - a,
        }
        if topk:  # the target's top-k, in a store that holds them
            mb.update(topk_ids=shard.topk_ids[a:b], topk_logprobs=shard.topk_logprobs[a:b])
            if getattr(shard, "topk_logtail", None) is not None:  # (a store written since it is kept)
                mb["topk_logtail"] = shard.topk_logtail[a:b]
        if getattr(shard, "hidden_scale", None) is not None:  # FP8: dequantized on the device
            mb["hidden_scale"] = shard.hidden_scale[a:b]
        out.append(mb)
    return out


def shard_microbatches(t: Trainer, shard) -> list[dict]:
    """A shard's microbatches under the token budget and the drafter-row budget (anchors x block)."""
    tc, rows = t.cfg.train, None
    if t.model.max_rows:
        counts = anchor_counts(shard.loss_mask, shard.cu_seqlens, tc.num_anchors)
        rows = [c * t.model.block_size for c in counts]
    return microbatches(shard, tc.microbatch_tokens, t.model.max_rows, rows)


class TimeBudget:
    """``--time-budget-s``: the run stops at the first step boundary past the budget (every rank
    alike: the decision is rank 0's clock, shared), and after each step the schedule's length
    (``Trainer.total_steps``) is refitted to the steps done plus those the time left affords at the
    recent step time, so a host that slows down (or speeds up) still ends its learning rate at 0
    when the time is up. The number of steps is not known in advance; the log says how many ran."""

    def __init__(self, t: Trainer):
        self.t, self.seconds = t, t.opts.time_budget_s
        self.t0, self.steps, self.recent = time.monotonic(), 0, []

    def step_done(self, step_s: float) -> None:
        if not self.seconds:
            return
        self.steps += 1
        self.recent = (self.recent + [step_s])[-20:]
        per = sorted(self.recent)[len(self.recent) // 2]  # the median of the last 20 steps
        left = self.seconds - (time.monotonic() - self.t0)
        self.t.total_steps = max(self.t.step + 1, self.t.step + int(left / max(per, 1e-6)))
        self.t.progress.total = self.t.total_steps  # the progress line shows the refitted length

    def over(self) -> bool:
        """Whether the budget is spent (collective: rank 0's clock decides for every rank)."""
        if not self.seconds:
            return False
        mine = self.t.dist.rank == 0 and time.monotonic() - self.t0 >= self.seconds
        return self.t.dist.any(mine)


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


def forward_backward(model, mbs: list[dict], device, knobs) -> dict:
    """Backpropagate every microbatch's weighted loss sum (gradients accumulate); the summed stats."""
    stats = model.zero_stats()
    for mb in mbs:
        loss_sum, st = model.loss({k: v.to(device, non_blocking=True) for k, v in mb.items()}, knobs)
        loss_sum.backward()
        model.add_stats(stats, st)
    return stats


def metrics_line(
    t: Trainer, jobs: list[Consumed], stats: dict, lr: float, data: StepData | None, step_s: float
) -> dict:
    """This step's metrics line (loss and accuracies synchronise the host: every step on CPU,
    every ``train.log_every`` steps on CUDA)."""
    loss = acc = tau = None
    selector = {}
    if t.device.type != "cuda" or t.step % t.cfg.train.log_every == 0:
        t.dist.all_reduce_([stats[k].reshape(-1) for k in sorted(stats)])
        loss = float(stats["loss_sum"] / stats["weight_sum"].clamp_min(1e-12))
        loss = loss if math.isfinite(loss) else None
        acc = per_offset_accuracy(stats["correct"], stats["total"])
        tau = training_tau(stats["accepted"], stats["blocks"])
        selector = target_metrics(stats)  # with the target's logits: agreement, overlap, expected tau
        if getattr(t.model.drafter, "selector", None) is not None:
            selector.update(selector_metrics(stats))
        selector.update(t.model.drafter.family.metrics(stats))
        if t.model.drafter.d2t is not None:
            selector["draft_vocab_oov"] = float(stats["label_oov"]) / max(float(stats["total"].sum()), 1.0)
    choices = t.dist.sum_int(data.bucket_choices if data else 0)
    return {
        "step": t.step,
        "loss": loss,
        "lr": lr,
        "acc": acc,
        "tau": tau,
        **selector,
        "tokens": sum(c.tokens for c in jobs),
        "jobs": [c.job for c in jobs],
        "ranks": [c.rank for c in jobs],
        "buckets": [c.bucket for c in jobs],
        "lengths": [round(c.mean_len, 1) for c in jobs],
        "digests": [c.digest for c in jobs],
        "data_wait_s": round(data.wait_s if data else 0.0, 4),
        "step_s": round(step_s, 4),
        "buffer": len(t.buffer),
        "bucket_choices": choices,
    }


class BusyIdle:
    """This rank's seconds busy and waiting for data (:mod:`dflash_staged.manifest.balance`: counted
    from its first step's data on), published with its registration every ``PUBLISH_S`` and at the end
    (not in a replay: nothing to wait for, no registration)."""

    def __init__(self, t: Trainer):
        self.t, self.tally, self.mark, self.published = t, None, 0.0, 0.0

    def step(self, wait_s: float) -> None:
        """A step's data arrived after ``wait_s`` of waiting; the rest since the previous one was busy."""
        now = time.monotonic()
        if self.tally is None:
            self.tally = Tally(SIDES["train"], now)
        else:
            self.tally.add("data_wait_s", min(wait_s, now - self.mark))
            self.tally.add("busy_s", now - self.mark - wait_s)
        self.mark = now
        if now - self.published >= PUBLISH_S:
            self.publish()

    def publish(self, final: bool = False) -> None:
        t, now = self.t, time.monotonic()
        if t.opts.replay or self.tally is None:
            return
        if final:
            self.tally.add("busy_s", now - self.mark)
            self.mark = now
        self.published = now
        fig = {
            **self.tally.snapshot(now),
            **{"t": time.time(), "devices": [str(t.device)], "tp": 1, "host": my_identity()[0]},
            **{"run": t.dist.group_id, "rank": t.dist.rank},
        }
        try:
            t.m.report("train", fig, final=final)
        except DflashError as e:  # best effort: not worth stopping for
            print(f"train: could not publish the busy/idle figures: {e}", file=sys.stderr, flush=True)


def consumed_item(job, rank: int, shard) -> Consumed:
    """What the ledger records of one job a step trained on."""
    n = int(shard.input_ids.numel())
    return Consumed(
        job.id, rank, n, job.bucket, n / max(1, shard.cu_seqlens.numel() - 1), token_digest(shard.input_ids)
    )


def train_loop(t: Trainer) -> int:
    """The training loop; returns the exit code."""
    cfg, dist = t.cfg, t.dist
    stop, idle, nonfinite, budget = StopRequested(), BusyIdle(t), 0, TimeBudget(t)
    budget_spent = None
    while not (t.opts.max_steps and t.step >= t.opts.max_steps):
        if budget.over():
            print(
                f"train: time budget of {budget.seconds:g} s spent after {budget.steps} step(s) "
                f"(step {t.step}); stopping with a checkpoint",
                file=sys.stderr,
                flush=True,
            )
            budget_spent = ("stopped", f"at the time budget of {budget.seconds:g} s", "rerun to go on")
            break
        # ---- data: this step's shards (may wait, all ranks together; never holding unreleased shards) --
        # Between collectives, branch only on values every rank agreed on: a stop signal may reach
        # some ranks only (one rank's pid, or the gap between torchrun's signals to its ranks).
        data = gather_step(t, stop)
        if data is None:
            break  # every rank agreed to stop (gather_step's dist.any)
        idle.step(data.wait_s)
        local = data.shards
        if not dist.any(len(local) > 0):
            if not dist.any(not t.source.finished()):
                break  # drained
            continue  # every shard drawn failed verification and went back to extract: wait for more
        t_step = time.perf_counter()

        # ---- forward / backward over every microbatch of every shard ------------------------------
        mbs = [mb for _, shard in local for mb in shard_microbatches(t, shard)]
        stats = forward_backward(t.model, mbs, t.device, t.model.knobs(t.step, t.total_steps))

        # ---- optimizer step (gradients summed over ranks / the step's total loss weight), consume ----
        lr = t.optim.lr(t.step, t.total_steps)
        applied = t.optim.step(lr, stats["weight_sum"])  # agreed on every rank (all-reduced gradients)
        nonfinite = 0 if applied else nonfinite + 1
        t.step += 1
        mine = [consumed_item(job, dist.rank, shard) for job, shard in local]
        jobs: list[Consumed] = dist.gather_jobs(mine)
        t.ledger.record(t.step, jobs)
        t.ledger.poll()  # release the previous checkpoint's shards once their files are gone
        if t.device.type == "cuda":  # the step's kernels, not their launches (the optimizer synced already)
            torch.cuda.synchronize(t.device)
        step_s = time.perf_counter() - t_step
        budget.step_done(step_s)

        # ---- log --------------------------------------------------------------------------------
        line = metrics_line(t, jobs, stats, lr, data, step_s)
        if not applied:
            line.update(loss=None, skipped="non-finite loss or gradient: update not applied")
        t.metrics.write(line)
        if nonfinite >= NONFINITE_STOP:
            raise DflashError(
                f"train: the loss or its gradient was not finite for {nonfinite} steps in a row (steps "
                f"{t.step - nonfinite + 1}-{t.step}; none was applied): the drafter diverged, or its inputs "
                f"hold extreme values. Lower train.lr, check the data, or resume from the last checkpoint "
                f"in {t.opts.out}"
            )
        t.progress.step(
            t.step, line["loss"], line["tokens"] / max(step_s, 1e-9), len(t.buffer), t.buffer.capacity
        )

        # ---- checkpoint + release shards the checkpoint covers ------------------------------------
        stopping = dist.any(bool(stop))  # every rank agrees, since checkpointing is collective
        if t.step % cfg.train.checkpoint_every == 0 or stopping:
            t.checkpoint_and_release()
        if stopping:
            break
    # ---- the end: final checkpoint, release, report -------------------------------------------------
    stopping = dist.any(bool(stop))
    t.checkpoint_and_release()
    idle.publish(final=True)
    t.outcome = budget_spent  # (set once the final checkpoint is written: an error there says itself)
    if stopping:
        signum = stop.signum or signal.SIGTERM
        t.outcome = ("stopped", f"by {signal_name(signum)}", "rerun the same command to resume")
        return 128 + signum
    if t.outcome is None and t.opts.max_steps and t.step >= t.opts.max_steps:
        t.outcome = ("stopped", f"at --max-steps {t.opts.max_steps}", "rerun with more --max-steps to go on")
    code = t.source.final_status()
    if t.outcome is None and code == 0:
        t.outcome = ("done",)
    return code
