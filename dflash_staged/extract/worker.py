"""``dflash extract``: pull-based target workers writing hidden-state shards.

One worker *process* per device (``--devices cuda:0,cuda:1`` or ``cpu,cpu``),
started and supervised by :func:`run_extract`. Each worker loops:

1. claim the next pending job in manifest order, in the same transaction that
   checks the window (shards claimed, written or consumed but not released);
   while the window is full it waits and says so;
2. keep its lease alive from a heartbeat thread;
3. build the right-padded batch, run the early-stopped forward
   (:meth:`dflash_staged.target.Target.capture`), drop the padding;
4. hand the tensors to its background writer thread (device-to-host copy into
   pinned memory on a side stream on CUDA), which writes the shard under a
   temporary name and publishes it: rename into place and ``claimed -> written``
   happen under the manifest's write lock, and only if this attempt still holds
   the claim, so a worker that lost its claim never overwrites a newer shard.

At most two shards per worker are in host memory (one being written, one
waiting). SIGINT/SIGTERM make a worker finish its current job or give the
claim back; a worker exits when its supervisor dies (PR_SET_PDEATHSIG, and a
parent check). A worker killed with ``kill -9`` leaves a claim that the next
claim on this host reclaims at once (dead pid), and a temporary shard directory
that the next start removes. Errors return the job to pending (``failed`` after
``extract.max_attempts`` errors); a full disk gives the job back and stops with
a message naming the store and the bytes needed.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import click
import torch

from dflash_staged.config import Config, ExtractConfig
from dflash_staged.errors import DflashError
from dflash_staged.manifest import Manifest

POLL_S = 0.2
EXIT_DISK_FULL = 3
EXIT_ERROR = 2


@dataclass
class ExtractOptions:
    manifest: Path
    store: Path
    devices: list[str]
    window: int
    window_bytes: int
    lease_s: float
    max_attempts: int
    allow_slow_kernels: bool = False
    dtype: str | None = None  # override target.dtype for the shards' source model
    train_ranks: int = 1
    stay_while_training: bool = True


def window_check(cfg: Config, window: int, workers: int, ranks: int) -> tuple[str | None, str | None]:
    """(error, warning) about window W against the trainer: N = min_ready, C = capacity."""
    t = cfg.train
    n_need = t.min_ready * ranks
    per_ckpt = t.checkpoint_every * t.grad_accum * ranks
    comfortable = t.buffer_capacity * ranks + 3 * workers + per_ckpt
    if window < n_need:
        return (f"window {window} < train.min_ready {t.min_ready} x {ranks} rank(s) = {n_need}: the trainer "
                f"would wait forever for shards the extractor may not write. Raise --window to at least "
                f"{n_need} (comfortable: {comfortable}), or lower train.min_ready"), None
    if window < comfortable:
        return None, (f"window {window} < buffer capacity {t.buffer_capacity} x {ranks} rank(s) + 3 x {workers} "
                      f"worker(s) + {per_ckpt} shards consumed per checkpoint interval "
                      f"({t.checkpoint_every} steps x {t.grad_accum} x {ranks}) = {comfortable}: target workers "
                      "may idle while the trainer holds shards; raise --window to keep them busy")
    return None, None


# ---------------------------------------------------------------------------------------------- worker side
def _die_with_parent() -> None:
    try:  # Linux: SIGKILL this process when the supervisor dies
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Publisher:
    """Hands shards to the background :class:`~dflash_staged.writer.ShardWriter` (device -> pinned host
    copy on a side stream, then the staged write) and publishes each one under its claim when written."""

    def __init__(self, opts: ExtractOptions, store, lease: "_Lease", max_pending: int = 1):
        from dflash_staged.extract.writer import ShardWriter
        self.opts, self.store, self.lease = opts, store, lease
        self.writer = ShardWriter(store, max_pending=max_pending, stage_only=True)
        self._m: Manifest | None = None  # the writer thread's own manifest connection

    @property
    def error(self) -> BaseException | None:
        return self.writer.error

    def submit(self, job, hidden: torch.Tensor, input_ids, loss_mask, cu_seqlens, sample_ids) -> None:
        if self.writer.error is not None:
            raise self.writer.error
        self.writer.submit(job.epoch, job.id, hidden, input_ids, loss_mask, cu_seqlens, sample_ids,
                           on_done=lambda result, job=job: self._done(job, result))

    def _done(self, job, result) -> None:  # runs on the writer thread
        if self._m is None:
            self._m = Manifest.open(self.opts.manifest)
        try:
            if isinstance(result, BaseException):
                from dflash_staged.store import StoreFullError
                if isinstance(result, StoreFullError):
                    self._m.abandon(job, f"disk full: {result}")
                else:
                    self._m.fail(job, f"write failed: {type(result).__name__}: {result}", self.opts.max_attempts)
            else:
                publish_staged(self._m, self.store, job, result)
        finally:
            self.lease.drop(job)

    def close(self) -> None:
        """Wait for every submitted shard; re-raise the first write error."""
        self.writer.close()


def publish_staged(m: Manifest, store, job, staged) -> bool:
    """Rename the staged shard into place and mark it written, atomically with respect to other
    workers: both happen under the manifest's write lock and only if this attempt owns the claim."""
    with m.tx() as c:
        if not m._owned(c, job):
            store.discard_staged(staged)
            return False
        store.commit_staged(staged)
        c.execute("UPDATE jobs SET state='written', shard_bytes=?, checksum=?, lease_until=NULL, taken_by=NULL, "
                  "rank=NULL, step=NULL, error=NULL, updated=?, written_seq=(SELECT COALESCE(MAX(written_seq), 0) "
                  "+ 1 FROM jobs) WHERE id=?", (int(staged.info.nbytes), staged.info.checksum, time.time(), job.id))
    return True


class _Lease(threading.Thread):
    """Extends the leases of held jobs (being computed or waiting to be published) every lease_s / 3."""

    def __init__(self, opts: ExtractOptions):
        super().__init__(daemon=True, name="lease")
        self.opts = opts
        self.jobs: dict[int, object] = {}
        self.lost: set[int] = set()
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def hold(self, job) -> None:
        with self.lock:
            self.jobs[job.id] = job
            self.lost.discard(job.id)

    def drop(self, job) -> None:
        with self.lock:
            self.jobs.pop(job.id, None)

    def is_lost(self, job) -> bool:
        with self.lock:
            return job.id in self.lost

    def run(self) -> None:
        m = Manifest.open(self.opts.manifest)
        while not self.stop.wait(max(0.05, self.opts.lease_s / 3)):
            with self.lock:
                held = list(self.jobs.values())
            for job in held:
                if not m.extend_lease(job, self.opts.lease_s):
                    with self.lock:
                        self.lost.add(job.id)
        m.close()


def _batch_tensors(m: Manifest, job):
    from dflash_staged.model.target import pad_batch
    seqs, masks = [], []
    for sid in job.sample_ids:
        tok, mask = m.sample(sid)
        seqs.append(torch.from_numpy(tok.astype("int64")))
        masks.append(torch.from_numpy(mask.copy()))
    lengths = [len(s) for s in seqs]
    input_ids, attention_mask, _ = pad_batch(seqs, pad_id=0)
    packed_ids = torch.cat(seqs).to(torch.int32)
    loss_mask = torch.cat(masks).to(torch.uint8)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return input_ids, attention_mask, lengths, packed_ids, loss_mask, cu, torch.tensor(job.sample_ids, dtype=torch.int64)


def open_store_for(m: Manifest, store_root: Path, target, cfg: Config):
    """Create (atomically) or open the store for this manifest and target; record bytes per token."""
    from dflash_staged.store import ShardStore, StoreMeta
    logical = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[target.dtype]
    meta = StoreMeta(manifest_id=m.manifest_id, target_id=target.target_id, layer_ids=list(target.layer_ids),
                     hidden_size=target.hidden_size, logical_dtype=logical, compression=cfg.extract.compression)
    store = ShardStore.create_or_open(store_root, meta)
    bpt = len(target.layer_ids) * target.hidden_size * target.dtype.itemsize + 4 + 1
    if m.meta.get("bytes_per_token") != bpt:
        m.set_meta("bytes_per_token", bpt)
    if m.meta.get("layer_ids") in (None, []):
        m.set_meta("layer_ids", list(target.layer_ids))
    elif list(m.meta["layer_ids"]) != list(target.layer_ids):
        raise DflashError(f"{m.dir} was planned for tapped layers {m.meta['layer_ids']} but the target resolves "
                          f"{target.layer_ids}; re-plan or set target.target_layer_ids")
    return store


def worker_main(rank: int, device: str, opts: ExtractOptions, status_q) -> None:
    """One extract worker process. Exit code 0 = done/stopped, 3 = disk full, 2 = error."""
    _die_with_parent()
    sup = mp.parent_process()
    parent = sup.pid if sup is not None else os.getppid()
    if os.getppid() != parent:  # the supervisor died before PR_SET_PDEATHSIG took effect: no orphans
        sys.exit(EXIT_ERROR)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if device.startswith("cpu"):
        n = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        torch.set_num_threads(n or max(1, (os.cpu_count() or 1) // max(1, len(opts.devices))))
    worker_id = f"w{rank}-{os.getpid()}"
    m = Manifest.open(opts.manifest)
    cfg = m.config
    if opts.dtype:
        cfg.target.dtype = opts.dtype
    cfg.target.allow_slow_kernels = cfg.target.allow_slow_kernels or opts.allow_slow_kernels
    from dflash_staged.model.target import load_target, pack_unpadded
    try:
        target = load_target(cfg.target, device, layer_ids=m.meta.get("layer_ids") or None,
                             num_draft_layers=cfg.drafter.num_hidden_layers)
        store = open_store_for(m, opts.store, target, cfg)
    except DflashError as e:
        from dflash_staged.store import StoreFullError
        status_q.put(("error", rank, str(e)))
        sys.exit(EXIT_DISK_FULL if isinstance(e, StoreFullError) else EXIT_ERROR)
    lease = _Lease(opts)
    publisher = _Publisher(opts, store, lease)
    lease.start()
    waiting_since = None
    code = 0
    try:
        while not stop.is_set() and os.getppid() == parent:
            if publisher.error is not None:
                raise publisher.error
            r = m.claim(worker_id, window=opts.window, window_bytes=opts.window_bytes, lease_s=opts.lease_s)
            if r.job is None:
                if r.nothing_left and not _should_stay(m, opts):
                    break
                state = "window" if r.window_full else "idle"
                if waiting_since is None:
                    waiting_since = time.time()
                    status_q.put(("wait", rank, state, r.window))
                time.sleep(POLL_S)
                continue
            waiting_since = None
            job = r.job
            lease.hold(job)
            try:
                ids, attn, lengths, packed_ids, loss_mask, cu, sample_ids = _batch_tensors(m, job)
                captured = target.capture(ids, attn)
                hidden = pack_unpadded(captured, lengths)
            except Exception as e:  # noqa: BLE001 - the job goes back to pending / failed
                lease.drop(job)
                state = m.fail(job, f"{type(e).__name__}: {e}", opts.max_attempts)
                status_q.put(("job_error", rank, job.id, f"{type(e).__name__}: {e}", state))
                continue
            if lease.is_lost(job):
                lease.drop(job)
                continue  # someone else owns it now; drop our result
            # The lease stays held until the writer has published (or given back) the shard.
            publisher.submit(job, hidden, packed_ids, loss_mask, cu, sample_ids)
            status_q.put(("claimed", rank, job.id, int(packed_ids.numel())))
        publisher.close()
    except BaseException as e:  # noqa: BLE001
        from dflash_staged.store import StoreFullError
        code = EXIT_DISK_FULL if isinstance(e, StoreFullError) else EXIT_ERROR
        status_q.put(("error", rank, str(e) if isinstance(e, DflashError) else traceback.format_exc()))
    finally:
        try:
            publisher.close()
        except BaseException:  # noqa: BLE001
            pass
        lease.stop.set()
        with lease.lock:
            unpublished = list(lease.jobs.values())
        for job in unpublished:  # claimed, never handed to the writer (it had failed): give them back
            m.abandon(job, "worker stopped before writing it")
        m.close()
    sys.exit(code)


def _should_stay(m: Manifest, opts: ExtractOptions) -> bool:
    """Nothing to claim now. Stay (idle) while a live trainer may still send jobs back for
    re-extraction (a shard failing verification); leave once no trainer is running."""
    if not opts.stay_while_training:
        return False
    c = m.counts()
    if c["written"] == 0 and c["consumed"] == 0:
        return False
    return bool(m.live_procs("train"))


# ---------------------------------------------------------------------------------------------- supervisor
def run_extract(opts: ExtractOptions) -> int:
    """Start one worker per device, supervise them, show progress; return the exit code."""
    m = Manifest.open(opts.manifest)
    cfg = m.config
    err, warn = window_check(cfg, opts.window, len(opts.devices), opts.train_ranks)
    if err:
        raise DflashError(err)
    if warn:
        click.echo(f"warning: {warn}", err=True)
    if m.counts()["failed"]:
        n = m.retry_failed()
        click.echo(f"retrying {n} failed job(s)", err=True)
    if m.extract_done() and not _should_stay(m, opts):  # with a live trainer: stay for re-extractions
        st = m.status()
        click.echo(f"extract: nothing to do, every job of {st['epochs']} epoch(s) is extracted "
                   f"({st['jobs']['written']} written, {st['jobs']['released'] + st['jobs']['kept']} consumed)")
        return 0
    from dflash_staged.store import ShardStore
    if ShardStore.exists(opts.store):
        ShardStore.open(opts.store, expect={"manifest_id": m.manifest_id}).cleanup_temp()
    m.set_meta("extract_window", {"shards": opts.window, "bytes": opts.window_bytes, "workers": len(opts.devices)})
    proc_id = m.register("extract", info={"devices": opts.devices})
    m.log_event("start:extract", ",".join(opts.devices))
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
    total = sum(m.counts().values())
    codes: dict[int, int] = {}
    messages: list[str] = []
    t0, tokens0 = time.time(), _done_tokens(m)
    bar = click.progressbar(length=total, label="extract", show_pos=True, file=sys.stderr) \
        if sys.stderr.isatty() else None
    last_line = 0.0
    try:
        while True:
            _drain_status(status_q, messages)
            for i, w in enumerate(workers):
                if i not in codes and w.exitcode is not None:
                    codes[i] = w.exitcode
                    if w.exitcode not in (0, EXIT_DISK_FULL) and not stopping["n"]:
                        click.echo(f"extract: worker {i} ({opts.devices[i]}, pid {w.pid}) died with exit code "
                                   f"{w.exitcode}; its job will be reclaimed, the other workers go on", err=True)
                        _remove_dead_leftovers(opts, m)  # its half-written shard, if any
            c = m.counts()
            done = total - c["pending"] - c["claimed"] - c["failed"]
            win = m.window()
            rate = (_done_tokens(m) - tokens0) / max(1e-9, time.time() - t0)
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
                break
            time.sleep(POLL_S)
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
    c = m.counts()
    st = m.status()
    click.echo(f"extract: {'finished' if m.extract_done() else 'stopped'}: {c['written']} written, "
               f"{c['consumed'] + c['released'] + c['kept']} consumed, {c['pending']} pending, {c['failed']} failed "
               f"| window {st['window']['shards']} shards, {st['window']['bytes']:,} bytes")
    if any(code == EXIT_DISK_FULL for code in codes.values()):
        return EXIT_DISK_FULL
    if c["failed"]:
        return EXIT_ERROR
    if stopping["n"]:
        return 130
    if not m.extract_done():
        return EXIT_ERROR
    return 0


def _remove_dead_leftovers(opts: ExtractOptions, m: Manifest) -> None:
    """Remove the temporary shards of dead writers (a worker killed mid-write leaves one behind)."""
    from dflash_staged.store import ShardStore
    if ShardStore.exists(opts.store):
        ShardStore.open(opts.store, expect={"manifest_id": m.manifest_id}).cleanup_temp()


def _done_tokens(m: Manifest) -> int:
    r = m.conn.execute("SELECT COALESCE(SUM(real_tokens), 0) FROM jobs WHERE state IN "
                       "('written','consumed','released','kept')").fetchone()
    return int(r[0])


def _drain_status(q, messages: list[str]) -> None:
    while True:
        try:
            msg = q.get_nowait()
        except queue.Empty:
            return
        except (EOFError, OSError):
            return
        if msg[0] == "error":
            messages.append(f"worker {msg[1]}: {msg[2]}")
        elif msg[0] == "job_error":
            messages.append(f"worker {msg[1]}: job {msg[2]} failed ({msg[3]}); now {msg[4]}")


def options_from(manifest: Path, store: Path, devices: str, cfg: ExtractConfig, *, window=None, window_bytes=None,
                 allow_slow_kernels=False, dtype=None, train_ranks=1, lease_s=None) -> ExtractOptions:
    devs = [d.strip() for d in devices.split(",") if d.strip()]
    if not devs:
        raise DflashError("--devices is empty: give e.g. 'cpu', 'cpu,cpu' or 'cuda:0,cuda:1'")
    for d in devs:
        if not (d == "cpu" or d.startswith("cuda")):
            raise DflashError(f"--devices: unknown device {d!r}; use cpu or cuda:N")
        if d.startswith("cuda") and not torch.cuda.is_available():
            raise DflashError(f"--devices {d}: CUDA is not available on this machine; use --devices cpu")
    return ExtractOptions(manifest=manifest, store=store, devices=devs,
                          window=window if window is not None else cfg.window,
                          window_bytes=window_bytes if window_bytes is not None else cfg.window_bytes,
                          lease_s=lease_s if lease_s is not None else cfg.lease_s, max_attempts=cfg.max_attempts,
                          allow_slow_kernels=allow_slow_kernels, dtype=dtype, train_ranks=train_ranks)
