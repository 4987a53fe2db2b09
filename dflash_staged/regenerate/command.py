"""``dflash regenerate``: read the conversations, skip those already answered, feed batches to one
worker process per device (each pulls the next batch when it is free), report progress, and
write the output once every conversation is answered (see :mod:`dflash_staged.regenerate.parts`)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import time
from pathlib import Path

import click
import numpy as np

from dflash_staged.children import Children, Progress, SpawnedChild
from dflash_staged.errors import DflashError
from dflash_staged.regenerate.conversations import read_conversations
from dflash_staged.regenerate.parts import finish, load_done, parts_dir
from dflash_staged.regenerate.worker import BatchDone, GenOptions, WorkerFailed, worker_main

POLL_S = 0.2
STOP_GRACE_S = 30.0  # at the end, workers still running (the supervisor failed) get this long to stop


def _batches(convs, batch_size: int) -> list[list]:
    """Conversations of similar length together (less padding), in groups of ``batch_size``."""
    order = sorted(convs, key=lambda c: (sum(len(t["content"]) for t in c.turns), c.line))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _already_written(out: Path, lines: list[int]) -> bool:
    """OUT exists: True if it answers exactly these lines (nothing to do), else an error."""
    import json

    try:
        got = [
            json.loads(x)["regenerated"]["line"]
            for x in out.read_text(encoding="utf-8").splitlines()
            if x.strip()
        ]
    except (OSError, ValueError, KeyError, TypeError):
        got = None
    if got == lines:
        return True
    raise DflashError(
        f"{out} exists and is not the regenerated form of this prompts file; choose another --out "
        "or delete it"
    )


def run_regenerate(prompts: Path, o: GenOptions, batch_size: int = 16) -> dict:
    """Answer every conversation of ``prompts`` into ``o.out``; returns the summary (also printed)."""
    convs = read_conversations(prompts)
    lines = [c.line for c in convs]
    if o.out.exists() and not parts_dir(o.out).exists() and _already_written(o.out, lines):
        click.echo(
            f"regenerate: {o.out} already holds the answers to all {len(lines)} conversations; nothing to do"
        )
        return {"conversations": len(lines), "answered_now": 0}
    done = load_done(o.out)
    stray = sorted(set(done) - set(lines))
    if stray:
        raise DflashError(
            f"{parts_dir(o.out)} holds answers to lines {stray[:5]} that {prompts} does not have: it "
            "belongs to another prompts file; delete it or choose another --out"
        )
    todo = _batches([c for c in convs if c.line not in done], batch_size)
    if done:
        click.echo(f"regenerate: resuming, {len(done)}/{len(lines)} conversations already answered", err=True)
    if todo:
        _run_workers(todo, o, total=len(lines), already=len(done))
    done = load_done(o.out)
    finish(o.out, lines, done)
    summary = summarize([done[n]["regenerated"] for n in lines])
    click.echo(format_summary(summary, o.out))
    return summary


def _run_workers(todo: list[list], o: GenOptions, total: int, already: int) -> None:
    """Feed the batches to one worker per device until each is answered; a worker's error stops the
    others after their batch, a signal stops them all (a second one kills them)."""
    ctx = mp.get_context("spawn")
    work_q, status_q = ctx.Queue(maxsize=2 * len(o.devices)), ctx.Queue()
    workers: list[SpawnedChild] = []
    children = Children(lambda: workers)
    pending = list(todo) + [None] * len(o.devices)  # then one sentinel per worker
    answered, tokens, errors = already, 0, []
    t0 = time.time()
    progress = Progress("regenerate", total)
    with children.forwarding(signal.SIGINT, signal.SIGTERM):
        try:
            for i, d in enumerate(o.devices):
                workers.append(SpawnedChild(ctx, f"regenerate-{i}", worker_main, (i, d, o, work_q, status_q)))
            children.catch_up()
            while any(w.alive() for w in workers):
                while pending and not children.stopping:
                    try:
                        work_q.put(pending[0], timeout=0.01)
                    except queue.Full:
                        break
                    pending.pop(0)
                try:
                    while True:
                        msg = status_q.get(timeout=POLL_S)
                        if isinstance(msg, BatchDone):
                            answered += msg.conversations
                            tokens += msg.new_tokens
                        elif isinstance(msg, WorkerFailed):
                            errors.append(f"worker {msg.worker}: {msg.text}")
                except queue.Empty:
                    pass
                rate = tokens / max(1e-9, time.time() - t0)
                progress.show(answered, f"{answered}/{total} conversations | {rate:,.0f} new tok/s")
                if errors and not children.stopping:
                    children.stop()  # one worker failed: stop the others after their batch
        finally:
            children.close(grace=STOP_GRACE_S)
    if errors:
        raise DflashError(
            "; ".join(errors)[-2000:] + f" (answers so far are kept in {parts_dir(o.out)}; rerun to go on)"
        )
    if children.signals:
        raise DflashError(
            f"stopped by a signal; {answered}/{total} conversations answered and kept in "
            f"{parts_dir(o.out)}; rerun the same command to go on"
        )
    if any(w.code for w in workers):
        raise DflashError(f"a worker died (exit codes {[w.code for w in workers]}); rerun to finish")


def summarize(recs: list[dict]) -> dict:
    lens = np.asarray([n for r in recs for n in r["new_tokens"]], dtype=np.int64)
    stops = [s for r in recs for s in r["stop"]]
    pct = {f"p{q}": int(np.percentile(lens, q)) for q in (50, 90, 99)} if lens.size else {}
    return {
        "conversations": len(recs),
        "turns": int(lens.size),
        "new_tokens": int(lens.sum()),
        "new_tokens_per_turn": {**pct, "max": int(lens.max()) if lens.size else 0},
        "stops": {k: stops.count(k) for k in ("eos", "length")},
    }


def format_summary(s: dict, out: Path) -> str:
    p = s["new_tokens_per_turn"]
    return (
        f"regenerate: wrote {out}: {s['conversations']:,} conversations, {s['turns']:,} answers, "
        f"{s['new_tokens']:,} new tokens (per answer: median {p.get('p50', 0)}, p90 {p.get('p90', 0)}, "
        f"max {p['max']}); stopped at eos {s['stops']['eos']:,}, at the length cap {s['stops']['length']:,}"
    )
