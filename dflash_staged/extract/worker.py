"""One extract worker process: pull a job, run the target, hand the shard to the writer, publish.

Each worker loops (see :mod:`dflash_staged.extract.supervisor` for the process model):

1. claim the next pending job in manifest order, in the same transaction that checks the window
   (:meth:`~dflash_staged.manifest.Manifest.claim`); while the window is full it waits (the seconds
   it spends busy, on a full window or with nothing to claim go to the supervisor:
   :class:`~dflash_staged.extract.messages.Stopwatch`);
2. keep its lease alive from a heartbeat thread (:class:`~dflash_staged.extract.claims.Lease`);
3. build the right-padded batch, run the early-stopped forward
   (:meth:`dflash_staged.model.target.Target.capture`), drop the padding;
4. hand the tensors to the background :class:`~dflash_staged.extract.writer.ShardWriter`
   (device-to-host copy into pinned memory on a side stream on CUDA), which stages the shard
   under a temporary name; :class:`~dflash_staged.extract.claims.Publisher` publishes it: the rename and
   ``claimed -> written`` happen in one manifest transaction, only if this attempt still holds
   the claim, so a worker that lost its claim never overwrites a newer shard.

At most two shards per worker are in host memory (one being written, one waiting); the loop
drops its own reference to a job's hidden states before the next forward. Errors return the job
to pending (``failed`` after ``extract.max_attempts`` errors; states that are not finite are never
published, and fail the job at its second such attempt); out of memory also frees the cache
and names the setting to lower (:mod:`dflash_staged.extract.forward`); a full disk gives the job
back and stops the worker with :data:`EXIT_DISK_FULL`.

A tensor-parallel worker (``--tp N``) is N processes: the leader runs this loop and broadcasts
each batch to the followers, which run the same forward (:mod:`dflash_staged.extract.group`); a
forward that raises on any rank ends that process with :data:`EXIT_RESTART`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from dflash_staged.config import Config
from dflash_staged.dtypes import dtype_name
from dflash_staged.errors import DflashError
from dflash_staged.extract.claims import Lease, Publisher
from dflash_staged.extract.forward import (
    NONFINITE_ATTEMPTS,
    RankFailed,
    batch_tensors,
    bind_device,
    counts_attempt,
    describe_failure,
    exit_at_once,
    job_forward,
    nonfinite_error,
    nonfinite_layers,
)
from dflash_staged.extract.group import Group, GroupBroken, follow
from dflash_staged.extract.messages import JobError, Stopwatch, WorkerError
from dflash_staged.extract.options import EXIT_DISK_FULL, EXIT_ERROR, EXIT_RESTART, ExtractOptions
from dflash_staged.manifest import Manifest
from dflash_staged.procs import die_with_parent
from dflash_staged.store import ShardStore, StoreFullError, StoreMeta

POLL_S = 0.2


def _keeps_tail(store_root: Path) -> bool:
    """Whether this run's shards carry the top-k's tail: yes, unless it continues a store written before
    the tail was kept (its shards stay alike; the trainer says what that costs)."""
    if not ShardStore.exists(store_root):
        return True
    meta = ShardStore.open(store_root).meta
    if meta.topk and not meta.topk_tail:
        print(
            f"extract: store {store_root} was started without the top-k's tail (an older version): its "
            "shards go on without it; extract into a new store to keep the tail exactly",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True


def open_store_for(m: Manifest, store_root: Path, target, cfg: Config) -> ShardStore:
    """Create (atomically) or open the store for this manifest and target; record bytes per token."""
    meta = StoreMeta(
        manifest_id=m.manifest_id,
        target_id=target.target_id,
        layer_ids=list(target.layer_ids),
        hidden_size=target.hidden_size,
        logical_dtype=dtype_name(target.dtype),
        compression=cfg.extract.compression,
        last_layer=target.last_layer,
        topk=target.topk,
        topk_temperature=target.topk_temperature,
        topk_tail=bool(target.topk) and _keeps_tail(store_root),
        store_dtype=cfg.extract.store_dtype,
    )
    store = ShardStore.create_or_open(store_root, meta)
    bpt = store.bytes_per_token
    if m.meta.get("bytes_per_token") != bpt:
        m.set_meta("bytes_per_token", bpt)
    if m.meta.get("layer_ids") in (None, []):
        m.set_meta("layer_ids", list(target.layer_ids))
    elif list(m.meta["layer_ids"]) != list(target.layer_ids):
        raise DflashError(
            f"{m.address} was planned for tapped layers {m.meta['layer_ids']} but the target resolves "
            f"{target.layer_ids}; re-plan or set target.target_layer_ids"
        )
    return store


TRAINER_GRACE_S = 10.0  # how long after its start extract waits for a trainer started beside it to register
TRAINER_COMING_S = 300.0  # the same, when a launcher said a trainer is coming (--trainer-coming)


def should_stay(m: Manifest, opts: ExtractOptions) -> bool:
    """Nothing to claim now. Stay (idle) while a live trainer may still send jobs back for
    re-extraction (a shard failing verification); leave once no trainer is running. Until
    ``opts.trainer_deadline`` (extract's start + :data:`TRAINER_GRACE_S`, or :data:`TRAINER_COMING_S`
    with ``--trainer-coming``), a trainer this process has not seen yet may still be starting: stay."""
    c = m.counts()
    if c["written"] == 0 and c["consumed"] == 0:
        return False
    if m.live_procs("train"):
        opts.trainer_seen = True
        return True
    return not opts.trainer_seen and time.time() < opts.trainer_deadline


def _loop(
    m: Manifest,
    target,
    publisher: Publisher,
    lease: Lease,
    opts: ExtractOptions,
    rank: int,
    status_q,
    keep_going,
    group: Group,
) -> None:
    """Claim, compute, hand over, until nothing is left (or ``keep_going()`` turns false). Each pass
    from one claim to the next is busy, on a full window or with nothing to claim
    (:mod:`dflash_staged.manifest.balance`); the seconds go to the supervisor (:class:`Stopwatch`)."""
    worker_id, watch = f"w{rank}-{os.getpid()}", Stopwatch(rank, status_q)
    while watch.going(keep_going):
        hidden = topk = None  # the previous job's states are the writer's now: not held through this forward
        if publisher.error is not None:
            raise publisher.error
        r = m.claim(
            worker_id,
            window=opts.window,
            window_bytes=opts.window_bytes,
            lease_s=opts.lease_s,
            node=opts.node,
        )
        if r.job is None:
            watch.kind = "window_full_s" if r.window_full else "no_work_s"
            if r.nothing_left and not should_stay(m, opts):
                watch.lap(send=True)
                return
            group.idle()
            time.sleep(POLL_S)
            continue
        watch.kind = "busy_s"
        job = r.job
        lease.hold(job)
        error, in_forward, counted, attempts = None, False, True, opts.max_attempts
        try:
            ids, attn, lengths, packed_ids, loss_mask, cu, sample_ids = batch_tensors(m, job)
        except Exception as e:  # noqa: BLE001 - the job goes back to pending / failed
            error = f"{type(e).__name__}: {e}"
        else:
            group.send(("job", ids, attn))  # the followers run the same forward
            try:
                hidden = job_forward(target, ids, attn, lengths)
                if target.topk:  # from the last layer (a tensor-parallel group's ranks all run the head)
                    topk = target.topk_of(hidden[:, -1])
            except Exception as e:  # noqa: BLE001
                error, in_forward, counted = describe_failure(e, ids, target.device), True, counts_attempt(e)
                if isinstance(e, torch.OutOfMemoryError):  # said now, not only in the closing report
                    print(f"extract: worker {rank}: job {job.id}: {error}", file=sys.stderr, flush=True)
            else:
                group.all_ok(True)  # the followers' forwards returned too (a broken group raises)
                bad = nonfinite_layers(hidden, list(target.captured_ids))
                if bad:
                    error, attempts = nonfinite_error(job, bad, target.dtype), NONFINITE_ATTEMPTS
                    hidden = None
                elif target.topk:  # the last layer was captured for the top-k: kept only if stored
                    hidden = hidden[:, : len(target.stored_ids)]
        if error is not None:
            lease.drop(job)
            try:
                if group.size > 1 and not counted:  # maybe another rank's death (extract.forward)
                    m.give_back(job, f"the tensor-parallel forward failed: {error}"[:2000])
                else:
                    state = m.fail(job, error, min(attempts, opts.max_attempts))
                    status_q.put(JobError(rank, job.id, error, state))
            finally:
                if in_forward and group.size > 1:  # no other collective may follow (extract.forward)
                    raise RankFailed(
                        f"rank 0 of a tensor-parallel group of {group.size}: the forward of job {job.id} "
                        f"failed ({error[:300]}); this process exits and the group is restarted"
                    )
            continue
        if lease.is_lost(job):
            lease.drop(job)
            continue  # someone else owns it now; drop our result
        # The lease stays held until the writer has published (or given back) the shard.
        publisher.submit(job, hidden, packed_ids, loss_mask, cu, sample_ids, topk)


def _load(cfg: Config, devices: list[str], device: str, m: Manifest, opts: ExtractOptions, tp: int):
    """The target of this worker: a transformers model (a rank's slice with ``tp > 1``) or a vLLM engine."""
    layer_ids = m.meta.get("layer_ids") or None
    transform = (cfg.drafter.output_multiplier, cfg.drafter.final_logit_softcapping)
    if opts.engine == "vllm":
        from dflash_staged.extract.vllm.engine import VllmTarget

        return VllmTarget(cfg, devices, layer_ids, cfg.drafter.num_hidden_layers, transform, opts.store)
    from dflash_staged.model.target import load_target

    return load_target(
        cfg.target,
        device,
        layer_ids=layer_ids,
        num_draft_layers=cfg.drafter.num_hidden_layers,
        tp=tp,
        logit_transform=transform,
    )


def worker_main(
    index: int, devices: list[str], rank: int, opts: ExtractOptions, status_q, init_file: str | None = None
) -> None:
    """Rank ``rank`` of extract worker ``index`` (one process on ``devices[0]``, or one rank of a
    tensor-parallel group on ``devices``). Exit code 0 = done/stopped, 3 = disk full, 2 = error.
    Reports go to ``status_q`` (:mod:`dflash_staged.extract.messages`)."""
    die_with_parent()
    sup = mp.parent_process()
    parent = sup.pid if sup is not None else os.getppid()
    if os.getppid() != parent:  # the supervisor died before PR_SET_PDEATHSIG took effect: no orphans
        sys.exit(EXIT_ERROR)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a follower waits for its leader's "stop"
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    device = devices[rank]
    vllm = opts.engine == "vllm"  # one process, one engine (extract.vllm.engine): vLLM places itself
    if not vllm:
        bind_device(device)  # before anything touches CUDA
    if device.startswith("cpu") and not vllm:
        n = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        torch.set_num_threads(n or max(1, (os.cpu_count() or 1) // max(1, len(opts.devices))))
    who = index if rank == 0 else f"{index} rank {rank}"
    try:
        group = (
            Group.join(devices, rank, init_file, opts.collective_timeout_s)
            if len(devices) > 1 and not vllm
            else Group()
        )
    except Exception as e:  # noqa: BLE001 - e.g. a sibling died before the group met
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        status_q.put(
            WorkerError(
                who,
                f"cannot join the tensor-parallel group on {','.join(devices)}: {type(e).__name__}: {first}",
            )
        )
        sys.exit(EXIT_ERROR)
    m = Manifest.open(opts.manifest, readonly=not group.leader)
    cfg = m.config
    if opts.dtype:
        cfg.target.dtype = opts.dtype
    cfg.target.allow_slow_kernels = cfg.target.allow_slow_kernels or opts.allow_slow_kernels
    error = None
    try:
        target = _load(cfg, devices, device, m, opts, group.size)
        store = open_store_for(m, opts.store, target, cfg) if group.leader else None
        if hasattr(target, "start"):  # a vLLM engine starts once its store exists (its scratch is in it)
            target.start()
    except Exception as e:  # noqa: BLE001 - reported; every rank of a group stops together
        error = (e, traceback.format_exc())
    try:
        loaded = group.all_ok(error is None)
    except GroupBroken as e:
        loaded, error = False, error or (e, "")
    if not loaded:
        if error is not None:
            status_q.put(WorkerError(who, str(error[0]) if isinstance(error[0], DflashError) else error[1]))
        group.close()
        sys.exit(EXIT_DISK_FULL if error and isinstance(error[0], StoreFullError) else EXIT_ERROR)
    if not group.leader:
        m.close()
        code = 0
        try:
            follow(target, group)
        except GroupBroken as e:  # the leader died: the supervisor stops (and restarts) the group
            status_q.put(WorkerError(who, str(e)))
            code = EXIT_ERROR
        except RankFailed as e:  # the others may be in a collective: no teardown (extract.forward)
            status_q.put(WorkerError(who, str(e)))
            exit_at_once(EXIT_RESTART, status_q)
        group.close()
        sys.exit(code)
    try:  # both open their own manifest handles now: an unreachable manifest is one clean line
        lease = Lease(opts)
        publisher = Publisher(opts, store, lease)
    except DflashError as e:
        status_q.put(WorkerError(who, str(e)))
        group.stop()
        group.close()
        sys.exit(EXIT_ERROR)
    lease.start()
    code = 0
    try:
        _loop(
            m,
            target,
            publisher,
            lease,
            opts,
            index,
            status_q,
            keep_going=lambda: not stop.is_set() and os.getppid() == parent,
            group=group,
        )
        publisher.close()
    except BaseException as e:  # noqa: BLE001
        code = EXIT_RESTART if isinstance(e, RankFailed) else EXIT_ERROR
        code = EXIT_DISK_FULL if isinstance(e, StoreFullError) else code
        status_q.put(WorkerError(index, str(e) if isinstance(e, DflashError) else traceback.format_exc()))
    finally:
        if code != EXIT_RESTART:  # after a failed forward the followers may be in a model collective
            group.stop()
        try:
            publisher.close()
        except BaseException:  # noqa: BLE001
            pass
        lease.stop.set()
        try:
            for job in lease.held():  # claimed, never handed to the writer (it had failed): give them back
                m.give_back(job, "worker stopped before writing it")
        except DflashError:
            pass  # the manifest is unreachable: those claims return to pending when their leases expire
        m.close()
        if hasattr(target, "close"):  # a vLLM engine: its ranks and its scratch
            target.close()
        if code == EXIT_RESTART:
            exit_at_once(code, status_q)
        group.close()
    sys.exit(code)
