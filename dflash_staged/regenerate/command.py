"""``dflash regenerate``: read the conversations, skip those already answered, feed batches to one
worker process per device (each pulls the next batch when it is free), report progress, and
write the output once every conversation is answered (see :mod:`dflash_staged.regenerate.parts`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from pathlib import Path

import click
import numpy as np

from dflash_staged.errors import DflashError
from dflash_staged.regenerate.conversations import read_conversations
from dflash_staged.regenerate.parts import finish, load_done, parts_dir
from dflash_staged.regenerate.worker import GenOptions, worker_main

POLL_S = 0.2


def _batches(convs, batch_size: int) -> list[list]:
    """Conversations of similar length together (less padding), in groups of ``batch_size``."""
    order = sorted(convs, key=lambda c: (sum(len(t["content"]) for t in c.turns), c.line))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _already_written(out: Path, lines: list[int]) -> bool:
    """OUT exists: True if it answers exactly these lines (nothing to do), else an error."""
    import json
    try:
        got = [json.loads(x)["regenerated"]["line"] for x in out.read_text(encoding="utf-8").splitlines() if x.strip()]
    except (OSError, ValueError, KeyError, TypeError):
        got = None
    if got == lines:
        return True
    raise DflashError(f"{out} exists and is not the regenerated form of this prompts file; choose another --out "
                      "or delete it")


def run_regenerate(prompts: Path, o: GenOptions, batch_size: int = 16) -> dict:
    """Answer every conversation of ``prompts`` into ``o.out``; returns the summary (also printed)."""
    convs = read_conversations(prompts)
    lines = [c.line for c in convs]
    if o.out.exists() and not parts_dir(o.out).exists() and _already_written(o.out, lines):
        click.echo(f"regenerate: {o.out} already holds the answers to all {len(lines)} conversations; nothing to do")
        return {"conversations": len(lines), "answered_now": 0}
    done = load_done(o.out)
    stray = sorted(set(done) - set(lines))
    if stray:
        raise DflashError(f"{parts_dir(o.out)} holds answers to lines {stray[:5]} that {prompts} does not have: it "
                          "belongs to another prompts file; delete it or choose another --out")
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
    ctx = mp.get_context("spawn")
    work_q, status_q = ctx.Queue(maxsize=2 * len(o.devices)), ctx.Queue()
    workers = [ctx.Process(target=worker_main, args=(i, d, o, work_q, status_q), name=f"regenerate-{i}")
               for i, d in enumerate(o.devices)]
    stopping = {"n": 0}

    def on_signal(signum, _frame):
        stopping["n"] += 1
        for w in workers:
            if w.is_alive():
                os.kill(w.pid, signal.SIGTERM if stopping["n"] == 1 else signal.SIGKILL)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    for w in workers:
        w.start()
    pending = list(todo) + [None] * len(workers)  # then one sentinel per worker
    answered, tokens, errors = already, 0, []
    t0, last = time.time(), 0.0
    bar = click.progressbar(length=total, label="regenerate", show_pos=True, file=sys.stderr) \
        if sys.stderr.isatty() else None
    try:
        while any(w.is_alive() for w in workers):
            while pending and not stopping["n"]:
                try:
                    work_q.put(pending[0], timeout=0.01)
                except queue.Full:
                    break
                pending.pop(0)
            try:
                while True:
                    msg = status_q.get(timeout=POLL_S)
                    if msg[0] == "done":
                        answered += len(msg[2])
                        tokens += sum(sum(r["new_tokens"]) for r in msg[2])
                    else:
                        errors.append(f"worker {msg[1]}: {msg[2]}")
            except queue.Empty:
                pass
            rate = tokens / max(1e-9, time.time() - t0)
            if bar is not None:
                bar.pos, bar.label = answered, f"regenerate | {rate:,.0f} new tok/s"
                bar.render_progress()
            elif time.time() - last > 5:
                click.echo(f"regenerate: {answered}/{total} conversations | {rate:,.0f} new tok/s", err=True)
                last = time.time()
            if errors and not stopping["n"]:
                on_signal(signal.SIGTERM, None)  # one worker failed: stop the others after their batch
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    if errors:
        raise DflashError("; ".join(errors)[-2000:] + f" (answers so far are kept in {parts_dir(o.out)}; rerun to go on)")
    if stopping["n"]:
        raise DflashError(f"stopped by a signal; {answered}/{total} conversations answered and kept in "
                          f"{parts_dir(o.out)}; rerun the same command to go on")
    if any(w.exitcode for w in workers):
        raise DflashError(f"a worker died (exit codes {[w.exitcode for w in workers]}); rerun to finish")


def summarize(recs: list[dict]) -> dict:
    lens = np.asarray([n for r in recs for n in r["new_tokens"]], dtype=np.int64)
    stops = [s for r in recs for s in r["stop"]]
    pct = {f"p{q}": int(np.percentile(lens, q)) for q in (50, 90, 99)} if lens.size else {}
    return {"conversations": len(recs), "turns": int(lens.size), "new_tokens": int(lens.sum()),
            "new_tokens_per_turn": {**pct, "max": int(lens.max()) if lens.size else 0},
            "stops": {k: stops.count(k) for k in ("eos", "length")}}


def format_summary(s: dict, out: Path) -> str:
    p = s["new_tokens_per_turn"]
    return (f"regenerate: wrote {out}: {s['conversations']:,} conversations, {s['turns']:,} answers, "
            f"{s['new_tokens']:,} new tokens (per answer: median {p.get('p50', 0)}, p90 {p.get('p90', 0)}, "
            f"max {p['max']}); stopped at eos {s['stops']['eos']:,}, at the length cap {s['stops']['length']:,}")
