"""Chaos: extract (2 CPU workers) and train side by side over 2+ epochs while a seeded driver
kill -9s random processes (and processes kill themselves at chosen crash points), restarting them.

Afterwards: every job of every epoch was consumed by exactly one optimizer step (final
checkpoint and metrics), no shard failed verification, the window bound held throughout
(sampled), no orphan worker, no leftovers, and `dflash status --json` reports all released.
Replay a failing run with DFLASH_CHAOS_SEED=<seed printed by the run>.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest

from dflash_staged.manifest import Manifest
from dflash_staged.model.target.dims import target_dims

from chaos import Chaos
from helpers import plan, run, start, write_config, write_dataset
from pgcluster import BOTH, PG_SLOW
from rel_helpers import (
    assert_all_released_and_clean,
    assert_exactly_once,
    hooked_env,
    scan_store,
    tracebacks,
)

EXTRA = "[data]\ntoken_budget = 512\n"
WINDOW = 16
# crash-point self-kills (per occurrence), on top of the driver's kills
CRASH_TRAIN = {"consume": 0.02, "checkpoint": 0.05, "checkpoint_fsync": 0.01, "delete": 0.01}
CRASH_EXTRACT = {"commit": 0.02, "write": 0.002}


def max_shard_bytes(mdir) -> int:
    with Manifest.open(mdir, readonly=True) as m:
        _, hidden, _ = target_dims(m.config.target)
        per_token = len(m.meta["layer_ids"]) * hidden * 4 + 5
        return max(j.real_tokens for j in m.jobs()) * per_token + (16 << 10)


def chaos_case(tmp_path, kills: int, n: int, epochs: int, timeout_s: float, manifest=None, nproc: int = 1):
    seed = int(os.environ.get("DFLASH_CHAOS_SEED") or random.SystemRandom().randrange(2**31))
    mdir = plan(tmp_path, n, epochs, extra=EXTRA, manifest=manifest)
    store, run_dir = tmp_path / "store", tmp_path / "run"
    ddp = (
        {"nproc": nproc, "kinds": ("trainer", "rank"), "crash_train": None}
        if nproc > 1
        else {"crash_train": CRASH_TRAIN}
    )
    chaos = Chaos(
        tmp_path,
        mdir,
        store,
        run_dir,
        seed=seed,
        kills=kills,
        window=WINDOW,
        timeout_s=timeout_s,
        crash_extract=CRASH_EXTRACT,
        shard_bytes_max=max_shard_bytes(mdir),
        **ddp,
    )
    r = chaos.run()
    kinds = {}
    for _, kind, _ in r.kills:
        kinds[kind] = kinds.get(kind, 0) + 1
    print(
        f"chaos seed {seed}: {len(r.kills)} kills {kinds} + {len(r.crashes)} crash-point kills "
        f"{sorted(p for p, _ in r.crashes)}; restarts {r.restarts}; {r.samples} samples, max window "
        f"{r.max_window}/{WINDOW}, max shard entries on disk {r.max_entries}, max store bytes {r.max_bytes}; "
        f"{r.wall_s:.0f}s",
        flush=True,
    )
    logs = "".join(
        (tmp_path / f).read_text() for f in ("train.log", "extract.log") if (tmp_path / f).exists()
    )
    assert not tracebacks(logs), f"seed {seed}: a traceback in the logs:\n{tracebacks(logs)[:2]}"
    errors = [x for x in logs.splitlines() if re.match(r"(extract: worker \d+: |error: )", x)]
    assert not errors, f"seed {seed}: errors in the logs: {errors[:5]}"
    assert len(r.kills) >= kills, f"seed {seed}: only {len(r.kills)} kills happened"
    assert not r.violations, f"seed {seed}: {r.violations[:5]}"
    assert not r.orphans, f"seed {seed}: extract workers outlived their supervisor: {r.orphans}"
    assert_exactly_once(mdir, run_dir)
    with Manifest.open(mdir, readonly=True) as m:
        requeued = m.events("requeue")
        assert not requeued, f"seed {seed}: shards failed verification: {requeued[:5]}"
    assert_all_released_and_clean(mdir, store, run_dir)
    return r


@pytest.mark.parametrize("backend", PG_SLOW, indirect=True)
def test_chaos_kill9(tmp_path, backend):
    chaos_case(tmp_path, kills=6, n=64, epochs=2, timeout_s=400, manifest=backend.address(tmp_path))


@pytest.mark.slow
def test_chaos_kill9_slow(tmp_path):
    chaos_case(tmp_path, kills=50, n=96, epochs=4, timeout_s=1800)


@pytest.mark.parametrize(
    "backend", ["postgres", pytest.param("sqlite", marks=pytest.mark.slow)], indirect=True
)
def test_chaos_two_ranks_kill9(tmp_path, backend):
    """Two trainer ranks (gloo) beside extract; kill -9 of the whole trainer (launcher and ranks) three
    times, resumed each time: every job of every epoch trained once, with the tokens planned."""
    chaos_case(tmp_path, kills=3, n=64, epochs=2, timeout_s=400, manifest=backend.address(tmp_path), nproc=2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BOTH, indirect=True)
def test_chaos_two_ranks_kill9_slow(tmp_path, backend):
    chaos_case(
        tmp_path, kills=10, n=64, epochs=3, timeout_s=1200, manifest=backend.address(tmp_path), nproc=2
    )


def test_killed_writer_leftovers_removed(tmp_path):
    """Regression: a worker killed mid-write left its temporary shard until the next extract start;
    now its supervisor removes it, and a rerun completes with exactly one shard per job."""
    mdir = plan(tmp_path, n=12, epochs=1, extra=EXTRA)
    store = tmp_path / "store"
    env = hooked_env(crash_after={"write": 14})  # inside each worker's first or second shard
    r = run(["extract", "--manifest", mdir, "--store", store, "--devices", "cpu,cpu", "--window", 64], env)
    assert r.returncode == 2 and "died with exit code -9" in r.stderr, r.stdout + r.stderr
    assert (store / "zarr.json").is_file()
    assert scan_store(store)["temps"] == [], "a killed worker's temporary shard was left behind"
    r = run(["extract", "--manifest", mdir, "--store", store, "--devices", "cpu", "--window", 64])
    assert r.returncode == 0, r.stdout + r.stderr
    with Manifest.open(mdir, readonly=True) as m:
        assert m.counts()["written"] == sum(m.counts().values())
        assert sorted(scan_store(store)["published"]) == sorted((j.epoch, j.id) for j in m.jobs())
    assert scan_store(store)["temps"] == []


def test_workers_exit_when_supervisor_dies_during_their_startup(tmp_path):
    """Regression: a worker whose supervisor was killed before the worker set PR_SET_PDEATHSIG ran on
    as an orphan, claiming and writing jobs beside any replacement. Now it exits without working."""
    import psutil

    mdir = plan(tmp_path, n=12, epochs=1, extra=EXTRA)
    p = start(
        [
            "extract",
            "--manifest",
            mdir,
            "--store",
            tmp_path / "store",
            "--devices",
            "cpu,cpu",
            "--window",
            64,
        ],
        tmp_path / "extract.log",
    )
    kids: list = []
    deadline = time.time() + 60
    while len(kids) < 2 and time.time() < deadline:  # kill the supervisor as soon as both workers are spawned
        kids = [c for c in psutil.Process(p.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        time.sleep(0.01)
    assert len(kids) == 2, "the workers were not spawned"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    gone, alive = psutil.wait_procs(kids, timeout=60)
    assert not alive, f"orphaned workers still running: {[k.pid for k in alive]}"
    with Manifest.open(mdir, readonly=True) as m:
        assert m.counts()["pending"] == sum(m.counts().values()), m.counts()  # the orphans did no work


def test_cleanup_treats_zombie_writers_as_dead(tmp_path):
    """Regression: a writer killed but not yet reaped (a zombie: e.g. workers of a killed supervisor in a
    container whose init does not reap) counted as alive, so its temporary shard was never removed."""
    import socket
    import subprocess

    from dflash_staged.store import ShardStore, StoreMeta

    store = ShardStore.create_or_open(
        tmp_path / "store",
        StoreMeta(manifest_id="m", target_id="t", layer_ids=[1], hidden_size=4, logical_dtype="float32"),
    )
    zombie = subprocess.Popen(["true"])  # exits at once; not waited for, so it stays a zombie
    deadline = time.time() + 10
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.time() < deadline
        time.sleep(0.01)
    edir = tmp_path / "store" / "shards" / "e0"
    edir.mkdir()
    leftover = edir / f".tmp~j5~{zombie.pid}~deadbeef~{socket.gethostname()}"
    leftover.mkdir()
    live = edir / f".tmp~j6~{os.getpid()}~deadbeef~{socket.gethostname()}"  # a live writer's: kept
    live.mkdir()
    assert store.cleanup_temp() == 1
    assert not leftover.exists() and live.exists()
    zombie.wait()


def test_deletion_leftovers_whose_pid_is_reused_are_removed(tmp_path):
    """Regression: a ``.del~`` leftover named with a pid that now belongs to another live process (a
    container restarted under the same host name reuses low pids) was kept forever, outside every
    window count. A deletion entry is never needed again: any this process is not deleting goes."""
    import socket
    import subprocess

    from dflash_staged.store import ShardStore, StoreMeta

    store = ShardStore.create_or_open(
        tmp_path / "store",
        StoreMeta(manifest_id="m", target_id="t", layer_ids=[1], hidden_size=4, logical_dtype="float32"),
    )
    foreign = subprocess.Popen(["sleep", "60"])  # a live process that never deleted anything
    try:
        edir = tmp_path / "store" / "shards" / "e0"
        edir.mkdir()
        host = socket.gethostname()
        reused = edir / f".del~j5~{foreign.pid}~deadbeef~{host}"
        (reused / "hidden").mkdir(parents=True)
        (reused / "hidden" / "c.0.0.0").write_bytes(b"x" * 1000)
        mine = edir / f".del~j6~{os.getpid()}~deadbeef~{host}"  # this process is deleting it: kept
        mine.mkdir()
        writer = edir / f".tmp~j7~{foreign.pid}~deadbeef~{host}"  # a live writer's staged shard: kept
        writer.mkdir()
        assert store.cleanup_temp() == 1
        assert not reused.exists() and mine.exists() and writer.exists()
    finally:
        foreign.kill()
        foreign.wait()


def test_plan_killed_midway_leaves_nothing(tmp_path):
    """Regression: `dflash plan` killed while writing the manifest left its temporary directory for good;
    the next plan of that manifest now removes it (its creator is dead) and completes."""
    data = write_dataset(tmp_path / "data.jsonl", n=12)
    cfg = write_config(tmp_path / "cfg.toml", EXTRA)
    args = ["plan", "--config", cfg, "--data", data, "--manifest", tmp_path / "manifest"]
    r = run(args, hooked_env(crash_after={"manifest_npy": 2}))
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    assert not (tmp_path / "manifest").exists()
    assert list(tmp_path.glob(".manifest.tmp-*")), "the crash point was not reached"
    r = run(args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "manifest" / "manifest.db").is_file()
    assert not list(tmp_path.glob(".manifest.tmp-*"))


def test_a_worker_killed_mid_report_does_not_hang_the_others(tmp_path):
    """Regression: the workers shared one multiprocessing queue; a worker killed while it wrote a report
    left the queue's write lock held, so another worker's next report blocked, and that worker could
    never exit (Python joins a queue's feeder thread at exit): extract ran forever (seen in chaos)."""
    mdir = plan(tmp_path, n=12, epochs=1, extra=EXTRA)
    store = tmp_path / "store"
    r = run(
        ["extract", "--manifest", mdir, "--store", store, "--devices", "cpu,cpu", "--window", 64],
        hooked_env(die_holding_status_lock=True),
        timeout=120,
    )
    assert r.returncode in (0, 2) and "worker 0 (cpu" in r.stderr and "exit code -9" in r.stderr, (
        r.stdout + r.stderr
    )
    with Manifest.open(mdir, readonly=True) as m:
        assert m.counts()["written"] == sum(m.counts().values())  # worker 1 extracted everything, then left
