"""``dflash extract``: one worker process per device, started, watched and reported on.

:func:`run_extract` starts one :func:`~dflash_staged.extract.worker.worker_main` process per
device (``--devices cuda:0,cuda:1`` or ``cpu,cpu``), shows a progress line (jobs, real tokens/s,
window), and returns an exit code. SIGINT/SIGTERM make the workers finish their current job or
give the claim back (a second signal kills them); a worker exits when its supervisor dies
(PR_SET_PDEATHSIG, and a parent check). A worker killed with ``kill -9`` leaves a claim that
the next claim on this host reclaims at once (dead pid), and a temporary shard directory that
the supervisor removes. With a live trainer, extract stays (idle) once everything is extracted,
so it can re-extract shards that fail verification.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import time

import click

from dflash_staged.config import window_check
from dflash_staged.errors import DflashError
from dflash_staged.extract.options import EXIT_DISK_FULL, EXIT_ERROR, ExtractOptions
from dflash_staged.extract.worker import POLL_S, should_stay, worker_main
from dflash_staged.manifest import Manifest
from dflash_staged.store import ShardStore


def run_extract(opts: ExtractOptions) -> int:
    """Start one worker per device, supervise them, show progress; return the exit code."""
    m = Manifest.open(opts.manifest)
    err, warn = window_check(m.config, opts.window, len(opts.devices), opts.train_ranks)
    if err:
        raise DflashError(err)
    if warn:
        click.echo(f"warning: {warn}", err=True)
    if m.counts()["failed"]:
        click.echo(f"retrying {m.retry_failed()} failed job(s)", err=True)
    if m.extract_done() and not should_stay(m, opts):  # with a live trainer: stay for re-extractions
        g = m.progress()["jobs"]
        click.echo(f"extract: nothing to do, every job of {m.meta['epochs']} epoch(s) is extracted "
                   f"({g['extracted'] - g['trained']} written, {g['trained']} consumed)")
        return 0
    _remove_dead_leftovers(opts, m)
    m.set_meta("extract_window", {"shards": opts.window, "bytes": opts.window_bytes, "workers": len(opts.devices)})
    proc_id = m.register("extract", info={"devices": opts.devices})
    ctx = mp.get_context("spawn")
    status_q = ctx.Queue()
    workers = [ctx.Process(target=worker_main, args=(i, d, opts, status_q), name=f"extract-{i}", daemon=False)
               for i, d in enumerate(opts.devices)]
    stopping = {"n": 0}

    def on_signal(signum, _frame):
        stopping["n"] += 1
        for w in workers:
            if w.is_alive():
                os.kill(w.pid, signal.SIGTERM if stopping["n"] == 1 else signal.SIGKILL)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    for w in workers:
        w.start()
    codes: dict[int, int] = {}
    messages: list[str] = []
    try:
        _watch(m, opts, workers, codes, messages, status_q, stopping)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
        _drain_status(status_q, messages)
        for msg in messages:
            click.echo(f"extract: {msg}", err=True)
        _remove_dead_leftovers(opts, m)
        m.unregister(proc_id)
    c, g, win = m.counts(), m.progress()["jobs"], m.window()
    click.echo(f"extract: {'finished' if m.extract_done() else 'stopped'}: {c['written']} written, "
               f"{g['trained']} consumed, {c['pending']} pending, {c['failed']} failed "
               f"| window {win['shards']} shards, {win['bytes']:,} bytes")
    if any(code == EXIT_DISK_FULL for code in codes.values()):
        return EXIT_DISK_FULL
    if c["failed"]:
        return EXIT_ERROR
    if stopping["n"]:
        return 130
    if not m.extract_done():
        return EXIT_ERROR
    return 0


def _watch(m: Manifest, opts: ExtractOptions, workers, codes: dict, messages: list, status_q, stopping) -> None:
    """Until every worker has exited: collect exit codes and messages, draw the progress line."""
    total = sum(m.counts().values())
    t0, tokens0 = time.time(), m.progress()["tokens"]["extracted"]
    bar = click.progressbar(length=total, label="extract", show_pos=True, file=sys.stderr) \
        if sys.stderr.isatty() else None
    last_line = 0.0
    while True:
        _drain_status(status_q, messages)
        for i, w in enumerate(workers):
            if i not in codes and w.exitcode is not None:
                codes[i] = w.exitcode
                if w.exitcode not in (0, EXIT_DISK_FULL) and not stopping["n"]:
                    click.echo(f"extract: worker {i} ({opts.devices[i]}, pid {w.pid}) died with exit code "
                               f"{w.exitcode}; its job will be reclaimed, the other workers go on", err=True)
                    _remove_dead_leftovers(opts, m)  # its half-written shard, if any
        c, prog, win = m.counts(), m.progress(), m.window()
        done = total - prog["jobs"]["to_extract"] - c["failed"]
        rate = (prog["tokens"]["extracted"] - tokens0) / max(1e-9, time.time() - t0)
        wait = "waiting: window full" if win["shards"] >= opts.window and c["pending"] else "working"
        line = (f"jobs {done}/{total} | {rate:,.0f} real tok/s | window {win['shards']}/{opts.window} shards"
                f" {win['bytes'] / 2**20:,.1f} MiB | {wait}")
        if bar is not None:
            bar.pos = done
            bar.label = line
            bar.render_progress()
        elif time.time() - last_line > 5:
            click.echo(f"extract: {line}", err=True)
            last_line = time.time()
        if len(codes) == len(workers):
            return
        time.sleep(POLL_S)


def _remove_dead_leftovers(opts: ExtractOptions, m: Manifest) -> None:
    """Remove the temporary shards of dead writers (a worker killed mid-write leaves one behind; on a
    shared store, those of other hosts' writers whose claims were lost)."""
    if ShardStore.exists(opts.store):
        ShardStore.open(opts.store, expect={"manifest_id": m.manifest_id}).cleanup_temp(claimed=m.holds_claim)


def _drain_status(q, messages: list[str]) -> None:
    while True:
        try:
            msg = q.get_nowait()
        except (queue.Empty, EOFError, OSError):
            return
        if msg[0] == "error":
            messages.append(f"worker {msg[1]}: {msg[2]}")
        elif msg[0] == "job_error":
            messages.append(f"worker {msg[1]}: job {msg[2]} failed ({msg[3]}); now {msg[4]}")
