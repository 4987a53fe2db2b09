"""``dflash extract``: one worker per device (or per tensor-parallel group), started, watched and reported on.

:func:`run_extract` starts one :func:`~dflash_staged.extract.worker.worker_main` process per
device (``--devices cuda:0,cuda:1`` or ``cpu,cpu``), or with ``--tp N`` one process per device of
each group of N (:mod:`dflash_staged.extract.group`), shows a progress line (jobs, real tokens/s,
window), and returns an exit code. SIGINT/SIGTERM make the workers finish their current job or
give the claim back (a second signal kills them; :mod:`dflash_staged.children`); a worker exits
when its supervisor dies (PR_SET_PDEATHSIG, and a parent check). A worker killed with ``kill -9``
leaves a claim that the next claim on this host reclaims at once (dead pid), and a temporary
shard directory that the supervisor removes; the other workers go on. When a process of a
tensor-parallel group is killed, the supervisor kills the rest of the group at once (no rank is
left in a collective); when ranks exit with an error, the others get :data:`GROUP_GRACE_S` to
exit and report on their own first. A group whose process was killed by a signal, or whose
forward raised on a rank (:data:`~dflash_staged.extract.options.EXIT_RESTART`, see
:mod:`~dflash_staged.extract.forward`), is started again, up to :data:`GROUP_RESTARTS` times in a
row without progress (the count starts over once more tokens are extracted than at its previous
restart); its job goes back to pending like any dead worker's.
With a live trainer, extract stays (idle) once everything is extracted, so it can re-extract
shards that fail verification; a trainer started beside it gets a while to register first (the
stay rule, :func:`~dflash_staged.extract.worker.should_stay`).

The workers' busy and idle seconds (busy, on a full window, nothing to claim:
:mod:`dflash_staged.manifest.balance`) are summed here, published with this process's registration
every ``PUBLISH_S`` and once more at the end, shown on the progress line (the last minute) and, with
the trainer's and the bottleneck, in the closing lines.

Each worker reports (:mod:`dflash_staged.extract.messages`) on a status queue of its own, new at
each start: a process killed while it writes to a multiprocessing queue leaves the queue's write
lock held, and every other writer of that queue (and its exit, which flushes the queue) would
block on it forever.
"""

from __future__ import annotations

import contextlib
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

from dflash_staged.children import Children, Progress, SpawnedChild
from dflash_staged.errors import DflashError
from dflash_staged.extract.messages import Seconds, Status, WorkerError
from dflash_staged.extract.options import EXIT_DISK_FULL, EXIT_ERROR, EXIT_RESTART, ExtractOptions
from dflash_staged.extract.undrained import UndrainedWindow
from dflash_staged.extract.worker import POLL_S, TRAINER_COMING_S, TRAINER_GRACE_S, should_stay, worker_main
from dflash_staged.manifest import Manifest
from dflash_staged.manifest.balance import PUBLISH_S, SIDES, Tally, format_balance, shares
from dflash_staged.manifest.layout import node_of, settle_layout, unwanted_on
from dflash_staged.manifest.window import WindowSettings
from dflash_staged.preflight import writable_dir
from dflash_staged.procs import my_identity
from dflash_staged.store import ShardStore

GROUP_RESTARTS = 3  # restarts in a row of a tensor-parallel group (a rank killed, or its forward raised)
GROUP_GRACE_S = (
    10.0  # ranks still running this long after another rank of their group exited by itself are killed
)
STOP_GRACE_S = 30.0  # at the end, workers still running (the supervisor failed) get this long to stop


@dataclass
class _Worker:
    """One extract worker: one process, or the ``tp`` processes of a tensor-parallel group."""

    index: int
    devices: list[str]
    procs: list[SpawnedChild] = field(default_factory=list)
    code: int | None = None  # set once it is over: the leader's exit code, or the death of a group
    restarts: int = 0  # restarts since extraction last made progress (tokens_mark)
    tokens_mark: int = 0  # tokens extracted (all workers) at its previous restart
    wait_since: float = 0.0  # when a group's first rank exited on its own (the others then get GROUP_GRACE_S)
    queue: object = None  # its own status queue, new at each start (see the module docstring)
    seconds: dict = field(default_factory=dict)  # its latest Seconds (this start's)
    base: dict = field(default_factory=dict)  # the seconds of its earlier starts

    def start(self, ctx, opts: ExtractOptions, tmp: str | None) -> None:
        init = os.path.join(tmp, f"group{self.index}-{self.restarts}") if tmp else None
        self.base = {k: self.base.get(k, 0.0) + self.seconds.get(k, 0.0) for k in SIDES["extract"]}
        self.seconds = {}
        self.wait_since = 0.0
        self.queue = ctx.Queue()
        self.procs = []
        if opts.engine == "vllm":  # one process holds the engine; vLLM starts its own tensor-parallel ranks
            init = None
        for r in range(1 if opts.engine == "vllm" else len(self.devices)):
            name = f"extract-{self.index}" + (f"-rank{r}" if init else "")
            self.procs.append(
                SpawnedChild(ctx, name, worker_main, (self.index, self.devices, r, opts, self.queue, init))
            )

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def shard_bytes_max(m: Manifest, opts: ExtractOptions) -> int:
    """The largest shard this plan can produce: its longest job's real tokens x bytes per token (as
    recorded by a worker, else from the target's config, the tapped layers and the shards' dtype)."""
    bpt = int(m.meta.get("bytes_per_token") or 0)
    if not bpt:
        from dflash_staged.dtypes import resolve_dtype
        from dflash_staged.model.target import resolve_layer_ids
        from dflash_staged.model.target.dims import target_dims
        from dflash_staged.store import bytes_per_token

        cfg = m.config
        dims = target_dims(cfg.target)
        layers = m.meta.get("layer_ids") or resolve_layer_ids(
            cfg.target, dims.num_layers, cfg.drafter.num_hidden_layers
        )
        dtype = resolve_dtype(opts.dtype or cfg.target.dtype, opts.devices[0])
        stored = len(layers) + (1 if cfg.target.store_last_layer else 0)  # + the last layer, when stored
        bpt = bytes_per_token(
            stored, dims.hidden_size, dtype.itemsize, cfg.target.store_topk, cfg.extract.store_dtype
        )
    return max((j.real_tokens for j in m.jobs()), default=0) * bpt


def run_extract(opts: ExtractOptions) -> int:
    """Start one worker per device (or per group of ``--tp`` devices), supervise them, show progress;
    return the exit code."""
    writable_dir(opts.store, "--store")  # a file, or a disk it cannot write: one line, before any worker
    opts.trainer_deadline = time.time() + (TRAINER_COMING_S if opts.trainer_coming else TRAINER_GRACE_S)
    m = Manifest.open(opts.manifest)
    opts.node = node_of(settle_layout(m, opts.node_local, "dflash extract"))
    opts.engine = m.config.target.engine
    window = WindowSettings(
        opts.window, opts.window_bytes, len(opts.groups), shard_bytes_max(m, opts) if opts.window_bytes else 0
    )
    err, warn = window.check(m.config, opts.train_ranks)
    if err:
        raise DflashError(err)
    if warn:
        click.echo(f"warning: {warn}", err=True)
    if opts.tp > 1 and opts.engine == "transformers":  # vLLM checks its own tensor parallel
        from dflash_staged.model.target.dims import target_text_config
        from dflash_staged.model.target.parallel import check_tp

        check_tp(target_text_config(m.config.target), opts.tp, f"target.model={m.config.target.model!r}")
    if m.counts()["failed"]:
        click.echo(f"retrying {m.retry_failed()} failed job(s)", err=True)
    _remove_dead_leftovers(opts, m)  # a node back with stale shards removes them, with work or without
    if m.extract_done() and not _wait_for_trainer(m, opts):  # with a live trainer: stay for re-extractions
        g = m.progress()["jobs"]
        click.echo(
            f"extract: nothing to do, every job of {m.meta['epochs']} epoch(s) is extracted "
            f"({g['extracted'] - g['trained']} written, {g['trained']} consumed)"
        )
        return 0
    m.set_meta(WindowSettings.KEY, window.to_meta())
    return ExtractSupervisor(m, opts).run()


class ExtractSupervisor:
    """One run of the workers of ``opts.groups`` on manifest ``m``: started, watched until each is
    over (restarting a killed tensor-parallel group), reported on; :meth:`run` returns the exit code."""

    def __init__(self, m: Manifest, opts: ExtractOptions):
        self.m, self.opts = m, opts
        self.ctx = mp.get_context("spawn")
        self.tmp: str | None = None  # the tensor-parallel groups' rendezvous files
        self.workers = [_Worker(i, g) for i, g in enumerate(opts.groups)]
        self.children = Children(lambda: [p for w in self.workers for p in w.procs])
        self.messages: list[str] = []  # the workers' reports, printed at the end
        self.tally = Tally(SIDES["extract"], time.monotonic())  # the workers' seconds (manifest.balance)
        self.published, self.figures = 0.0, self.tally.snapshot(time.monotonic())
        self.balance_lines: list[str] = []

    def run(self) -> int:
        m, opts = self.m, self.opts
        proc_id = m.register("extract", info={"devices": opts.devices, "tp": opts.tp})
        try:
            self.tmp = (
                tempfile.mkdtemp(prefix="dflash-tp-") if opts.tp > 1 and opts.engine != "vllm" else None
            )
            with self.children.forwarding(signal.SIGINT, signal.SIGTERM):
                try:
                    for w in self.workers:
                        w.start(self.ctx, opts, self.tmp)
                    self.children.catch_up()
                    self._watch()
                finally:
                    self.children.close(grace=STOP_GRACE_S)
        finally:
            self._drain_status()
            for msg in self.messages:
                click.echo(f"extract: {msg}", err=True)
            _remove_dead_leftovers(opts, m)
            self._publish(final=True)
            with contextlib.suppress(DflashError):
                self.balance_lines = format_balance(m.balance())
            m.unregister(proc_id)
            if self.tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)
        return self._report()

    def _report(self) -> int:
        """The closing lines, and the exit code."""
        m, opts, stopped = self.m, self.opts, self.children.stopping
        c, g, win = m.counts(), m.progress()["jobs"], m.window()
        click.echo(
            f"extract: {'finished' if m.extract_done() else 'stopped'}: {c['written']} written, "
            f"{g['trained']} consumed, {c['pending']} pending, {c['failed']} failed "
            f"| window {win['shards']} shards, {win['bytes']:,} bytes"
        )
        for line in self.balance_lines:
            click.echo(f"extract: {line}")
        if opts.trainer_coming and not opts.trainer_seen and not stopped:
            click.echo(
                f"extract: no trainer registered on {m.address} within {TRAINER_COMING_S:.0f} s, "
                "although the launcher started one; check its output",
                err=True,
            )
        if any(w.code == EXIT_DISK_FULL for w in self.workers):
            return EXIT_DISK_FULL
        if c["failed"]:
            return EXIT_ERROR
        if stopped:
            return 130
        if not m.extract_done():
            return EXIT_ERROR
        return 0

    def _watch(self) -> None:
        """Until every worker is over: collect exit codes and reports, draw the progress line."""
        m, opts = self.m, self.opts
        total = sum(m.counts().values())
        t0, tokens0 = time.time(), m.progress()["tokens"]["extracted"]
        progress = Progress("extract", total)
        undrained = UndrainedWindow(m.address, opts.store)
        while True:
            self._drain_status()
            for w in self.workers:
                if w.code is None:
                    self._check(w)
            if opts.trainer_coming and not opts.trainer_seen:  # for the end's note: did a trainer come?
                opts.trainer_seen = bool(m.live_procs("train"))
            c, prog, win = m.counts(), m.progress(), m.window()
            done = total - prog["jobs"]["to_extract"] - c["failed"]
            rate = (prog["tokens"]["extracted"] - tokens0) / max(1e-9, time.time() - t0)
            full = win["shards"] >= opts.window and c["pending"]
            wait = "waiting: window full" if full else "working"
            notice = undrained.line(full, lambda: m.live_procs("train"))
            if notice:
                click.echo(notice, err=True)
            fig = self._publish()
            recent = shares(fig["recent"])
            idle = (
                f"last {fig['recent_s']:.0f} s: busy {recent['busy_s']:.0%}, window full "
                f"{recent['window_full_s']:.0%}, nothing to claim {recent['no_work_s']:.0%}"
                if sum(fig["recent"].values()) > 0
                else "no busy/idle figures yet"
            )
            progress.show(
                done,
                f"jobs {done}/{total} | {rate:,.0f} real tok/s | window {win['shards']}/"
                f"{opts.window} shards {win['bytes'] / 2**20:,.1f} MiB | {wait} | {idle}",
            )
            if all(w.code is not None for w in self.workers):
                return
            time.sleep(POLL_S)

    def _check(self, w: _Worker) -> None:
        """Set ``w.code`` once worker ``w`` is over."""
        if len(w.procs) == 1:
            w.code = w.procs[0].poll()
            if w.code not in (None, 0, EXIT_DISK_FULL) and not self.children.stopping:
                click.echo(
                    f"extract: worker {w.index} ({w.devices[0]}, pid {w.procs[0].pid}) died with "
                    f"exit code {w.code}; its job will be reclaimed, the other workers go on",
                    err=True,
                )
                _remove_dead_leftovers(self.opts, self.m)  # its half-written shard, if any
        else:
            self._check_group(w)

    def _check_group(self, w: _Worker) -> None:
        """A group with a dead process is stopped whole, and restarted when that process was killed
        by a signal or its forward raised (up to GROUP_RESTARTS times in a row)."""
        codes = [p.poll() for p in w.procs]
        dead = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        killed = [(r, c) for r, c in dead if c < 0]
        failed = [(r, c) for r, c in dead if c == EXIT_RESTART]
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
        _remove_dead_leftovers(self.opts, self.m)
        rank, code = (killed or failed or dead)[0]  # name the cause: the others followed it
        if code == EXIT_DISK_FULL or self.children.stopping:
            w.code = code
            return
        tokens = self.m.progress()["tokens"]["extracted"]
        if tokens > w.tokens_mark:  # progress since its previous restart: the count starts over
            w.restarts, w.tokens_mark = 0, tokens
        again = (
            bool(killed or failed)
            and w.restarts < GROUP_RESTARTS
            and (not self.m.extract_done() or should_stay(self.m, self.opts))
        )
        how = "was killed" if killed else "failed in a forward" if failed else "exited with an error"
        click.echo(
            f"extract: worker {w.index} (tensor-parallel group {','.join(w.devices)}, leader pid "
            f"{w.procs[0].pid}): rank {rank} (pid {w.procs[rank].pid}) {how} (exit code {code}); the "
            "whole group is stopped and a job it held goes back to pending; "
            + (f"restarting it ({w.restarts + 1} of {GROUP_RESTARTS})" if again else "not restarting it"),
            err=True,
        )
        if again:
            w.restarts += 1
            w.start(self.ctx, self.opts, self.tmp)
            self.children.catch_up()  # a signal that came while it started
        else:
            w.code = code

    def _publish(self, final: bool = False) -> dict:
        """The workers' seconds (each second once per device of a worker) summed; every PUBLISH_S,
        and as the final figures, a snapshot published with this process's registration
        (:mod:`dflash_staged.manifest.balance`). Returns the latest snapshot."""
        now = time.monotonic()
        if not final and now - self.published < PUBLISH_S:
            return self.figures
        self.tally.set(
            {
                k: sum((w.base.get(k, 0.0) + w.seconds.get(k, 0.0)) * len(w.devices) for w in self.workers)
                for k in SIDES["extract"]
            }
        )
        host, self.published = my_identity()[0], now
        self.figures = {
            **self.tally.snapshot(now),
            **{"t": time.time(), "devices": self.opts.devices, "tp": self.opts.tp, "host": host},
            **{"run": host, "rank": None},
        }
        try:
            self.m.report("extract", self.figures, final=final)
        except DflashError as e:  # best effort: not worth stopping for
            click.echo(f"extract: could not publish the busy/idle figures: {e}", err=True)
        return self.figures

    def _drain_status(self) -> None:
        """The workers' reports, once each, into ``messages``; their seconds into ``_Worker.seconds``."""
        for w in self.workers:
            while w.queue is not None:
                try:
                    msg = w.queue.get_nowait()
                except (queue.Empty, EOFError, OSError):
                    break
                if isinstance(msg, Seconds):
                    w.seconds = msg.seconds
                    continue
                if not isinstance(msg, Status):
                    continue  # (a test hook's own)
                if isinstance(msg, WorkerError) and any(x.endswith(f": {msg.text}") for x in self.messages):
                    continue  # the ranks of a group agree: say it once
                self.messages.append(msg.line())


def _wait_for_trainer(m: Manifest, opts: ExtractOptions) -> bool:
    """Every job is extracted: whether to stay (:func:`should_stay`), first waiting until the stay
    rule's deadline for a trainer that was started beside extract but has not registered yet."""
    said = False
    try:
        while should_stay(m, opts) and not opts.trainer_seen:
            if not said:
                left = opts.trainer_deadline - time.time()
                click.echo(
                    f"extract: every job is extracted; waiting up to {left:.0f} s for a trainer to "
                    "register (it may send damaged shards back for re-extraction)",
                    err=True,
                )
                said = True
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        click.echo("extract: interrupted while waiting for a trainer", err=True)
        sys.exit(130)
    if said and not opts.trainer_seen and opts.trainer_coming:
        click.echo(
            f"extract: no trainer registered on {m.address} within {TRAINER_COMING_S:.0f} s, "
            "although the launcher started one; leaving (check the trainer's output)",
            err=True,
        )
    return opts.trainer_seen


def _remove_dead_leftovers(opts: ExtractOptions, m: Manifest) -> None:
    """Remove the temporary shards of dead writers (a worker killed mid-write leaves one behind; on a
    shared store, those of other hosts' writers whose claims were lost), and shards renamed in after
    their jobs were released or sent back."""
    if ShardStore.exists(opts.store):
        store = ShardStore.open(opts.store, expect={"manifest_id": m.manifest_id})
        store.cleanup_temp(claimed=m.holds_claim, unwanted=unwanted_on(m, opts.node))
