"""``dflash regenerate``: read the conversations, skip those already answered, answer the others on
one of two paths, and write the output once every conversation is answered (see
:mod:`dflash_staged.regenerate.parts`).

In process, batches go to one worker process per device (each pulls the next batch when it is free).
With ``--server``, the servers are checked first (:mod:`~dflash_staged.regenerate.checks`), then the
conversations are answered through them (:mod:`~dflash_staged.regenerate.remote`). A conversation the
servers could not answer is skipped: the run ends with an error that lists them and keeps the answers,
so that a rerun tries them again, unless ``allow_skipped``: then OUT is written without them and
``OUT.skipped.jsonl`` lists them (line and reason), and a rerun finds nothing to do."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import signal
import time
from pathlib import Path

import click

from dflash_staged.children import Children, Progress, SpawnedChild
from dflash_staged.errors import DflashError
from dflash_staged.fsutil import atomic_write
from dflash_staged.regenerate.conversations import read_conversations
from dflash_staged.regenerate.options import GenOptions, ServerOptions
from dflash_staged.regenerate.parts import exclusive, finish, load_done, parts_dir
from dflash_staged.regenerate.report import format_summary, progress_line, skipped_line, summarize
from dflash_staged.regenerate.worker import BatchDone, WorkerFailed, worker_main

POLL_S = 0.2
STOP_GRACE_S = 30.0  # at the end, workers still running (the supervisor failed) get this long to stop


def _batches(convs, batch_size: int) -> list[list]:
    """Conversations of similar length together (less padding), in groups of ``batch_size``."""
    order = sorted(convs, key=lambda c: (sum(len(t["content"]) for t in c.turns), c.line))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def skipped_path(out: Path) -> Path:
    return out.with_name(out.name + ".skipped.jsonl")


def _listed_skipped(out: Path) -> set[int]:
    try:
        return {json.loads(x)["line"] for x in skipped_path(out).read_text().splitlines() if x.strip()}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _already_written(out: Path, lines: list[int]) -> bool:
    """OUT exists: True if it answers exactly these lines (nothing to do), else an error."""
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


def run_regenerate(
    prompts: Path, o: GenOptions, batch_size: int = 16, server: ServerOptions | None = None
) -> dict:
    """Answer every conversation of ``prompts`` into ``o.out``, in process or through ``server``; returns
    the summary (also printed). One run per ``o.out`` at a time (:func:`~.parts.exclusive`)."""
    convs = read_conversations(prompts)
    with exclusive(o.out):
        return _run(prompts, convs, o, batch_size, server)


def _run(prompts: Path, convs, o: GenOptions, batch_size: int, server: ServerOptions | None) -> dict:
    lines = [c.line for c in convs]
    skipped_before = _listed_skipped(o.out)
    expected = [n for n in lines if n not in skipped_before]
    if o.out.exists() and not parts_dir(o.out).exists() and _already_written(o.out, expected):
        more = f" ({len(skipped_before)} skipped, listed in {skipped_path(o.out)})" if skipped_before else ""
        click.echo(
            f"regenerate: {o.out} already holds the answers to all {len(expected)} conversations{more}; "
            "nothing to do"
        )
        return {"conversations": len(expected), "answered_now": 0}
    done = load_done(o.out)
    stray = sorted(set(done) - set(lines))
    if stray:
        raise DflashError(
            f"{parts_dir(o.out)} holds answers to lines {stray[:5]} that {prompts} does not have: it "
            "belongs to another prompts file; delete it or choose another --out"
        )
    todo = [c for c in convs if c.line not in done]
    if done:
        click.echo(f"regenerate: resuming, {len(done)}/{len(lines)} conversations already answered", err=True)
    skipped: dict[int, str] = {}
    if todo and server is None:
        _run_workers(_batches(todo, batch_size), o, total=len(lines), already=len(done))
    elif todo:
        skipped = _run_servers(todo, convs, o, server, total=len(lines), already=len(done))
    done = load_done(o.out)
    if skipped and not server.allow_skipped:
        raise DflashError(
            f"{skipped_line(skipped, len(lines))}; the {len(done):,} answered are kept in "
            f"{parts_dir(o.out)}: rerun the same command to try the skipped again, or add --allow-skipped "
            f"to write {o.out} without them"
        )
    answered = [n for n in lines if n not in skipped]
    if skipped:
        rows = [
            json.dumps({"line": n, "reason": skipped[n]}, ensure_ascii=False) + "\n" for n in sorted(skipped)
        ]
        atomic_write(skipped_path(o.out), "".join(rows))
    elif skipped_path(o.out).exists():
        os.unlink(skipped_path(o.out))
    finish(o.out, answered, done)
    summary = summarize([done[n]["regenerated"] for n in answered], skipped)
    click.echo(format_summary(summary, o.out))
    return summary


def _run_servers(todo, convs, o: GenOptions, s: ServerOptions, total: int, already: int) -> dict[int, str]:
    """Check the servers, answer ``todo`` through them; returns the skipped lines and why."""
    from dflash_staged.model.target import load_tokenizer
    from dflash_staged.regenerate.checks import connect
    from dflash_staged.regenerate.remote import run_remote

    key = None
    if s.api_key_env:
        key = os.environ.get(s.api_key_env)
        if not key:
            raise DflashError(f"--api-key-env {s.api_key_env}: that environment variable is not set or empty")
    servers = connect(o, s, load_tokenizer(o.target), convs, key)
    click.echo(
        "regenerate: answering through "
        + ", ".join(f"{sv.ep.url} ({sv.model}, {sv.concurrency} at once)" for sv in servers),
        err=True,
    )
    r = run_remote(todo, o, s, servers, total, already)
    kept = f"{already + r.answered}/{total} conversations answered and kept in {parts_dir(o.out)}"
    if r.fatal:
        raise DflashError(f"{r.fatal} ({kept}; rerun to go on)")
    if r.signalled:
        raise DflashError(f"stopped by a signal; {kept}; rerun the same command to go on")
    if r.left:
        gone = "; ".join(f"{url}: {why}" for url, why in r.gone.items())
        raise DflashError(f"every server stopped answering ({gone}); {kept}; rerun the same command to go on")
    return r.skipped


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
                progress.show(
                    answered, progress_line(answered, total, answered - already, tokens, time.time() - t0)
                )
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
