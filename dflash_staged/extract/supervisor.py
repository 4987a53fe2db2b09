"""``dflash extract``: one worker per device (or per tensor-parallel group), started, watched and reported on.

:func:`run_extract` starts one :func:`~dflash_staged.extract.worker.worker_main` process per
device (``--devices cuda:0,cuda:1`` or ``cpu,cpu``), or with ``--tp N`` one process per device of
each group of N (:mod:`dflash_staged.extract.group`), shows a progress line (jobs, real tokens/s,
window), and returns an exit code. SIGINT/SIGTERM make the workers finish their current job or
give the claim back (a second signal kills them); a worker exits when its supervisor dies
(PR_SET_PDEATHSIG, and a parent check). A worker killed with ``kill -9`` leaves a claim that
the next claim on this host reclaims at once (dead pid), and a temporary shard directory that
the supervisor removes; the other workers go on. When a process of a tensor-parallel group is
killed, the supervisor kills the rest of the group at once (no rank is left in a collective);
when ranks exit with an error, the others get :data:`GROUP_GRACE_S` to exit and report on their
own first. A group whose process was killed by a signal is started again, up to
:data:`GROUP_RESTARTS` times; its job goes back to pending like any dead worker's. With a live
trainer, extract stays (idle) once everything is extracted, so it can re-extract shards that
fail verification; a trainer started beside it gets a while to register first (the stay rule,
:func:`~dflash_staged.extract.worker.should_stay`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

import click

from dflash_staged.manifest.window import window_check
from dflash_staged.errors import DflashError
from dflash_staged.extract.options import EXIT_DISK_FULL, EXIT_ERROR, ExtractOptions
from dflash_staged.extract.worker import POLL_S, TRAINER_COMING_S, TRAINER_GRACE_S, should_stay, worker_main
from dflash_staged.manifest import Manifest
from dflash_staged.store import ShardStore


GROUP_RESTARTS = 3  # restarts of a tensor-parallel group whose process was killed (kill -9, OOM killer)
GROUP_GRACE_S = 10.0  # ranks still running this long after another rank of their group exited by itself are killed


@dataclass
class _Worker:
    """One extract worker: one process, or the ``tp`` processes of a tensor-parallel group."""

    index: int
    devices: list[str]
    procs: list = field(default_factory=list)
    code: int | None = None  # set once it is over: the leader's exit code, or the death of a group
    restarts: int = 0
    wait_since: float = 0.0  # when a group's first rank exited on its own (the others then get GROUP_GRACE_S)
    # Its own status queue, new at each start: a process killed while it writes to a multiprocessing
    # queue leaves the queue's write lock held, and every other writer (and its exit) would block on it.
    queue: object = None

    def start(self, ctx, opts: ExtractOptions, tmp: str | None) -> None:
        init = os.path.join(tmp, f"group{self.index}-{self.restarts}") if tmp else None
        self.wait_since = 0.0
        self.queue = ctx.Queue()
        self.procs = [ctx.Process(target=worker_main, args=(self.index, self.devices, r, opts, self.queue, init),
                                  name=f"extract-{self.index}" + (f"-rank{r}" if init else ""), daemon=False)
                      for r in range(len(self.devices))]
        for p in self.procs:
            p.start()

    def kill(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join()


def shard_bytes_max(m: Manifest, opts: ExtractOptions) -> int:
    """The largest shard this plan can produce: its longest job's real tokens x bytes per token (as
    recorded by a worker, else from the target's config, the tapped layers and the shards' dtype)."""
    bpt = int(m.meta.get("bytes_per_token") or 0)
    if not bpt:
        from dflash_staged.dtypes import resolve_dtype
        from dflash_staged.model.dims import target_dims
        from dflash_staged.model.target import resolve_layer_ids
        from dflash_staged.store import bytes_per_token
        cfg = m.config
        dims = target_dims(cfg.target)
        layers = m.meta.get("layer_ids") or resolve_layer_ids(cfg.target, dims.num_layers,
                                                              cfg.drafter.num_hidden_layers)
        dtype = resolve_dtype(opts.dtype or cfg.target.dtype, opts.devices[0])
        bpt = bytes_per_token(len(layers), dims.hidden_size, dtype.itemsize)
    return max((j.real_tokens for j in m.jobs()), default=0) * bpt


def run_extract(opts: ExtractOptions) -> int:
    """Start one worker per device (or per group of ``--tp`` devices), supervise them, show progress;
    return the exit code."""
    opts.trainer_deadline = time.time() + (TRAINER_COMING_S if opts.trainer_coming else TRAINER_GRACE_S)
    m = Manifest.open(opts.manifest)
    groups = opts.groups
    largest = shard_bytes_max(m, opts) if opts.window_bytes else 0
    err, warn = window_check(m.config, opts.window, len(groups), opts.train_ranks,
                             window_bytes=opts.window_bytes, shard_bytes_max=largest)
    if err:
        raise DflashError(err)
    if warn:
        click.echo(f"warning: {warn}", err=True)
    if opts.tp > 1:
        from dflash_staged.model.dims import target_text_config
        from dflash_staged.model.parallel import check_tp
        check_tp(target_text_config(m.config.target), opts.tp, f"target.model={m.config.target.model!r}")
    if m.counts()["failed"]:
        click.echo(f"retrying {m.retry_failed()} failed job(s)", err=True)
    if m.extract_done() and not _wait_for_trainer(m, opts):  # with a live trainer: stay for re-extractions
        g = m.progress()["jobs"]
        click.echo(f"extract: nothing to do, every job of {m.meta['epochs']} epoch(s) is extracted "
                   f"({g['extracted'] - g['trained']} written, {g['trained']} consumed)")
        return 0
    _remove_dead_leftovers(opts, m)
    m.set_meta("extract_window", {"shards": opts.window, "bytes": opts.window_bytes, "workers": len(groups),
                                  "shard_bytes_max": largest})
    proc_id = m.register("extract", info={"devices": opts.devices, "tp": opts.tp})
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="dflash-tp-") if opts.tp > 1 else None  # the groups' rendezvous files
    workers = [_Worker(i, g) for i, g in enumerate(groups)]
    stopping = {"n": 0}

    def on_signal(signum, _frame):
        stopping["n"] += 1
        for w in workers:
            for p in w.procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM if stopping["n"] == 1 else signal.SIGKILL)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    for w in workers:
        w.start(ctx, opts, tmp)
    messages: list[str] = []
    try:
        _watch(m, opts, workers, messages, stopping, ctx, tmp)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for w in workers:
            for p in w.procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        _drain_status(workers, messages)
        for msg in messages:
            click.echo(f"extract: {msg}", err=True)
        _remove_dead_leftovers(opts, m)
        m.unregister(proc_id)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    c, g, win = m.counts(), m.progress()["jobs"], m.window()
    click.echo(f"extract: {'finished' if m.extract_done() else 'stopped'}: {c['written']} written, "
               f"{g['trained']} consumed, {c['pending']} pending, {c['failed']} failed "
               f"| window {win['shards']} shards, {win['bytes']:,} bytes")
    if opts.trainer_coming and not opts.trainer_seen and not stopping["n"]:
        click.echo(f"extract: no trainer registered on {m.address} within {TRAINER_COMING_S:.0f} s, "
                   "although the launcher started one; check its output", err=True)
    if any(w.code == EXIT_DISK_FULL for w in workers):
        return EXIT_DISK_FULL
    if c["failed"]:
        return EXIT_ERROR
    if stopping["n"]:
        return 130
    if not m.extract_done():
        return EXIT_ERROR
    return 0


def _wait_for_trainer(m: Manifest, opts: ExtractOptions) -> bool:
    """Every job is extracted: whether to stay (:func:`should_stay`), first waiting until the stay
    rule's deadline for a trainer that was started beside extract but has not registered yet."""
    said = False
    try:
        while should_stay(m, opts) and not opts.trainer_seen:
            if not said:
                left = opts.trainer_deadline - time.time()
                click.echo(f"extract: every job is extracted; waiting up to {left:.0f} s for a trainer to "
                           "register (it may send damaged shards back for re-extraction)", err=True)
                said = True
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        click.echo("extract: interrupted while waiting for a trainer", err=True)
        sys.exit(130)
    if said and not opts.trainer_seen and opts.trainer_coming:
        click.echo(f"extract: no trainer registered on {m.address} within {TRAINER_COMING_S:.0f} s, "
                   "although the launcher started one; leaving (check the trainer's output)", err=True)
    return opts.trainer_seen


def _check_worker(m: Manifest, opts: ExtractOptions, w: _Worker, stopping, ctx, tmp) -> None:
    """Set ``w.code`` once worker ``w`` is over. A group with a dead process is stopped whole, and
    restarted when that process was killed by a signal (up to GROUP_RESTARTS times)."""
    codes = [p.exitcode for p in w.procs]
    if len(w.procs) == 1:
        if codes[0] is not None:
            w.code = codes[0]
            if w.code not in (0, EXIT_DISK_FULL) and not stopping["n"]:
                click.echo(f"extract: worker {w.index} ({w.devices[0]}, pid {w.procs[0].pid}) died with exit code "
                           f"{w.code}; its job will be reclaimed, the other workers go on", err=True)
                _remove_dead_leftovers(opts, m)  # its half-written shard, if any
        return
    dead = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
    killed = [(r, c) for r, c in dead if c < 0]
    if None in codes and not killed and (dead or codes[0] == 0):
        # the leader is done (it told the followers to stop), or ranks exited with an error (the others
        # follow them): they get a grace to exit on their own and report, then are killed
        w.wait_since = w.wait_since or time.time()
        if time.time() - w.wait_since < GROUP_GRACE_S:
            return
    elif None in codes and not dead:
        return
    w.kill()  # no rank of a broken group may wait for the others
    if not dead:
        w.code = 0
        return
    _remove_dead_leftovers(opts, m)
    rank, code = (killed or dead)[0]  # name the one killed by a signal: the others followed it
    if code == EXIT_DISK_FULL or stopping["n"]:
        w.code = code
        return
    again = bool(killed) and w.restarts < GROUP_RESTARTS and (not m.extract_done() or should_stay(m, opts))
    how = "was killed" if killed else "exited with an error"
    click.echo(f"extract: worker {w.index} (tensor-parallel group {','.join(w.devices)}, leader pid "
               f"{w.procs[0].pid}): rank {rank} (pid {w.procs[rank].pid}) {how} (exit code {code}); the whole "
               "group is stopped and a job it held goes back to pending; "
               + (f"restarting it ({w.restarts + 1} of {GROUP_RESTARTS})" if again else "not restarting it"),
               err=True)
    if again:
        w.restarts += 1
        w.start(ctx, opts, tmp)
    else:
        w.code = code


def _watch(m: Manifest, opts: ExtractOptions, workers: list[_Worker], messages: list, stopping, ctx,
           tmp) -> None:
    """Until every worker is over: collect exit codes and messages, draw the progress line."""
    total = sum(m.counts().values())
    t0, tokens0 = time.time(), m.progress()["tokens"]["extracted"]
    bar = click.progressbar(length=total, label="extract", show_pos=True, file=sys.stderr) \
        if sys.stderr.isatty() else None
    last_line = 0.0
    while True:
        _drain_status(workers, messages)
        for w in workers:
            if w.code is None:
                _check_worker(m, opts, w, stopping, ctx, tmp)
        if opts.trainer_coming and not opts.trainer_seen:  # for the end's note: did the trainer ever come?
            opts.trainer_seen = bool(m.live_procs("train"))
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
        if all(w.code is not None for w in workers):
            return
        time.sleep(POLL_S)


def _remove_dead_leftovers(opts: ExtractOptions, m: Manifest) -> None:
    """Remove the temporary shards of dead writers (a worker killed mid-write leaves one behind; on a
    shared store, those of other hosts' writers whose claims were lost), and shards renamed in after
    their jobs were released or sent back."""
    if ShardStore.exists(opts.store):
        store = ShardStore.open(opts.store, expect={"manifest_id": m.manifest_id})
        store.cleanup_temp(claimed=m.holds_claim, unwanted=m.shard_unwanted)


def _drain_status(workers: list[_Worker], messages: list[str]) -> None:
    """The workers' error reports, once each, into ``messages``."""
    for w in workers:
        if w.queue is not None:
            _drain_one(w.queue, messages)


def _drain_one(q, messages: list[str]) -> None:
    while True:
        try:
            msg = q.get_nowait()
        except (queue.Empty, EOFError, OSError):
            return
        if msg[0] == "error":
            if not any(x.endswith(f": {msg[2]}") for x in messages):  # the ranks of a group agree: say it once
                messages.append(f"worker {msg[1]}: {msg[2]}")
        elif msg[0] == "job_error":
            messages.append(f"worker {msg[1]}: job {msg[2]} failed ({msg[3]}); now {msg[4]}")
