"""A seeded chaos driver: `dflash extract` and `dflash train` side by side, kill -9 at random.

The driver keeps two extract workers and one trainer alive until training finishes. Kill i
happens once pipeline progress (jobs extracted + jobs trained, out of 2 x jobs) passes a
seeded random threshold, so kills are spread over the whole run whatever the machine's speed.
Each kill SIGKILLs one process chosen at random among the trainer, the extract supervisors
and the extract workers (the first three kills cover each kind once), among those alive for a
random minimum age, so most kills land in real work rather than in interpreter start-up.
With ``nproc`` > 1 the trainer is ``dflash train --nproc N`` (torchrun, N ranks on gloo), and a
trainer kill is a kill -9 of the whole trainer: the launcher and every rank; a ``rank`` kill is a
SIGTERM to one rank only (a stop that reaches some ranks: every rank must checkpoint and stop,
and the trainer is restarted).
Killed processes are restarted: the trainer with the same command line (it resumes), extract
workers by starting another `dflash extract` with the missing number of workers. Processes
can also kill themselves at chosen crash points (see hooks/dflash_fault_hooks.py).

While it runs the driver samples the manifest's window and the store, and records violations.
The seed is printed and replayable with DFLASH_CHAOS_SEED (timing still varies).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from dflash_staged.manifest import Manifest

from helpers import start
from rel_helpers import hooked_env, scan_store

KINDS = ("trainer", "supervisor", "worker")


@dataclass
class Report:
    seed: int
    kills: list = field(default_factory=list)  # (t, kind, pid)
    crashes: list = field(default_factory=list)  # self-kills at crash points: (point, pid)
    restarts: dict = field(default_factory=lambda: {"trainer": 0, "extract": 0})
    max_window: int = 0
    max_entries: int = 0
    max_bytes: int = 0
    violations: list = field(default_factory=list)
    samples: int = 0
    wall_s: float = 0.0
    orphans: list = field(default_factory=list)

    @property
    def survived(self) -> int:
        return len(self.kills) + len(self.crashes)


class Chaos:
    def __init__(
        self,
        tmp: Path,
        mdir: Path,
        store: Path,
        run_dir: Path,
        *,
        seed: int,
        kills: int,
        window: int,
        crash_train: dict | None = None,
        crash_extract: dict | None = None,
        timeout_s: float = 600,
        shard_bytes_max: int = 0,
        nproc: int = 1,
        kinds: tuple = KINDS,
    ):
        self.tmp, self.mdir, self.store, self.run_dir = tmp, mdir, store, run_dir
        self.nproc = nproc
        self.seen_ranks: set[int] = set()
        self.rng = random.Random(seed)
        self.report = Report(seed)
        self.target_kills, self.window, self.timeout_s = kills, window, timeout_s
        self.shard_bytes_max = shard_bytes_max
        self.crash_log = tmp / "crashes.log"
        self.env_train = (
            hooked_env(crash=crash_train, crash_log=str(self.crash_log), seed=seed)
            if crash_train
            else hooked_env()
        )
        self.env_extract = (
            hooked_env(crash=crash_extract, crash_log=str(self.crash_log), seed=seed)
            if crash_extract
            else hooked_env()
        )
        self.trainer: subprocess.Popen | None = None
        self.trainer_started = 0.0
        self.trainer_done = False
        self.extracts: list[tuple[subprocess.Popen, int, float]] = []  # (proc, workers, started)
        self.killed: set[int] = set()
        self.seen_workers: set[int] = set()
        self.thresholds = sorted(self.rng.uniform(0.03, 0.9) for _ in range(kills))
        first = list(kinds)
        self.rng.shuffle(first)
        self.kind_plan = first[:kills] + [self.rng.choice(kinds) for _ in range(max(0, kills - len(kinds)))]
        self.m = Manifest.open(mdir, readonly=True)
        self.total = sum(self.m.counts().values())

    # ------------------------------------------------------------------ processes
    def start_trainer(self) -> None:
        ranks = ["--nproc", self.nproc, "--device", "cpu"] if self.nproc > 1 else []
        self.trainer = start(
            ["train", "--manifest", self.mdir, "--store", self.store, "--out", self.run_dir, *ranks],
            self.tmp / "train.log",
            self.env_train,
        )
        self.trainer_started = time.time()
        self.trainer_termed = False  # a rank of it was sent SIGTERM: it exits non-zero, then restarts

    def start_extract(self, n: int) -> None:
        p = start(
            [
                "extract",
                "--manifest",
                self.mdir,
                "--store",
                self.store,
                "--devices",
                ",".join(["cpu"] * n),
                "--window",
                self.window,
            ],
            self.tmp / "extract.log",
            self.env_extract,
        )
        self.extracts.append((p, n, time.time()))

    def workers(self) -> list[psutil.Process]:
        out = []
        for p, _, _ in self.extracts:
            if p.poll() is not None:
                continue
            try:
                kids = psutil.Process(p.pid).children()
            except psutil.NoSuchProcess:
                continue
            for k in kids:
                try:
                    if "spawn_main" in " ".join(k.cmdline()) and k.status() != psutil.STATUS_ZOMBIE:
                        out.append(k)
                        self.seen_workers.add(k.pid)
                except psutil.NoSuchProcess:
                    pass
        return out

    def ranks(self) -> list[int]:
        """The trainer's ranks (torchrun's children), remembered to check for orphans at the end."""
        if self.nproc < 2 or self.trainer is None or self.trainer.poll() is not None:
            return []
        try:
            kids = [k.pid for k in psutil.Process(self.trainer.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        self.seen_ranks.update(kids)
        return kids

    def _expected_workers(self) -> int:
        """Workers alive or still starting (a young supervisor has not spawned them yet)."""
        n = 0
        for p, k, t0 in self.extracts:
            if p.poll() is not None:
                continue
            try:
                kids = [
                    c
                    for c in psutil.Process(p.pid).children()
                    if "spawn_main" in " ".join(c.cmdline()) and c.status() != psutil.STATUS_ZOMBIE
                ]
            except psutil.NoSuchProcess:
                continue
            n += len(kids) if time.time() - t0 > 15 or kids else k
        return n

    # ------------------------------------------------------------------ the loop
    def run(self) -> Report:
        t0 = time.time()
        print(
            f"chaos: seed {self.report.seed} (replay with DFLASH_CHAOS_SEED={self.report.seed}), "
            f"{self.target_kills} kills, {self.total} jobs, window {self.window}",
            flush=True,
        )
        self.start_extract(2)
        self.start_trainer()
        try:
            while True:
                if time.time() - t0 > self.timeout_s:
                    raise TimeoutError(
                        f"chaos run (seed {self.report.seed}) did not finish in {self.timeout_s}s"
                    )
                self.sample()
                self.workers()  # remember every worker pid, to check for orphans at the end
                self.ranks()
                if self.maintain():
                    break
                self.maybe_kill(time.time())
                time.sleep(0.05)
        finally:
            self.stop_all()
            self.report.wall_s = time.time() - t0
            if self.crash_log.exists():
                self.report.crashes = [tuple(x.split()) for x in self.crash_log.read_text().splitlines()]
            deadline = time.time() + 10  # workers die with their supervisor (PDEATHSIG): allow a moment
            while time.time() < deadline and any(_alive(pid) for pid in self.seen_workers):
                time.sleep(0.1)
            while time.time() < deadline and any(_alive(pid) for pid in self.seen_ranks):
                time.sleep(0.1)
            self.report.orphans = [pid for pid in self.seen_workers | self.seen_ranks if _alive(pid)]
            self.m.close()
        return self.report

    def progress(self) -> float:
        c = self.m.counts()
        extracted = c["written"] + c["consumed"] + c["released"] + c["kept"]
        trained = c["consumed"] + c["released"] + c["kept"]
        return (extracted + trained) / (2 * self.total)

    def sample(self) -> None:
        try:
            w = self.m.window()
        except Exception:  # noqa: BLE001 - a read may race a checkpoint of the WAL; skip the sample
            return
        scan = scan_store(self.store)
        r = self.report
        r.samples += 1
        entries = len(scan["published"]) + len(scan["temps"])
        r.max_window, r.max_entries = max(r.max_window, w["shards"]), max(r.max_entries, entries)
        r.max_bytes = max(r.max_bytes, scan["bytes"])
        # Kill -9 can leave at most one staged/committed shard per killed worker (a killed supervisor
        # takes two workers with it) and one half-deleted shard per killed trainer, until cleaned up.
        slack = 2 * (len(r.kills) + len(r.crashes))
        if w["shards"] > self.window:
            r.violations.append(f"manifest window {w['shards']} > {self.window}")
        over_bytes = (self.window + slack) * self.shard_bytes_max + (1 << 20) if self.shard_bytes_max else 0
        if entries > self.window + slack or (over_bytes and scan["bytes"] > over_bytes):
            # A directory listing is no snapshot: an epoch's shard listed just before the trainer deletes
            # it, and another epoch's shard published just after, both count. Over the bound twice in a
            # row is a real overshoot (leaked shards stay); once is the listing's race.
            again = scan_store(self.store)
            entries = min(entries, len(again["published"]) + len(again["temps"]))
            nbytes = min(scan["bytes"], again["bytes"])
            if entries > self.window + slack:
                r.violations.append(
                    f"{entries} shard entries on disk > window {self.window} + {slack} crash leftovers"
                )
            if over_bytes and nbytes > over_bytes:
                r.violations.append(f"store holds {nbytes} bytes > ({self.window} + {slack}) shards")

    def maintain(self) -> bool:
        """Restart what died; True once training has finished and every process has exited."""
        if self.trainer is not None and self.trainer.poll() is not None:
            rc = self.trainer.returncode
            if rc == 0:
                self.trainer_done = True
            elif rc == -signal.SIGKILL or self.trainer_termed:
                self.report.restarts["trainer"] += 1
                self.start_trainer()
            else:
                raise AssertionError(
                    f"trainer exited with {rc} (seed {self.report.seed}); see {self.tmp}/train.log"
                )
        live = []
        for p, n, t in self.extracts:
            if p.poll() is None:
                live.append((p, n, t))
            elif p.returncode not in (0, 2, -signal.SIGKILL):
                raise AssertionError(
                    f"extract exited with {p.returncode} (seed {self.report.seed}); "
                    f"see {self.tmp}/extract.log"
                )
        self.extracts = live
        if self.trainer_done:
            return not self.extracts
        c = self.m.counts()
        if c["pending"] + c["claimed"] > 0:
            missing = 2 - self._expected_workers()
            if missing > 0:
                self.report.restarts["extract"] += 1
                self.start_extract(missing)
        return False

    def maybe_kill(self, now: float) -> None:
        r = self.report
        i = len(r.kills)
        if i >= self.target_kills or self.trainer_done or self.progress() < self.thresholds[i]:
            return
        if r.kills and now - r.kills[-1][0] < 0.3:
            return
        min_age = self.rng.uniform(0.5, 6.0)
        kind = self.kind_plan[i]
        victims = self.candidates(kind, now, min_age) or self.candidates(kind, now, 0.0)
        if not victims:  # that kind is gone (e.g. extraction finished): take any process
            victims = [v for k in KINDS for v in self.candidates(k, now, 0.0)]
            kind = "any"
        if not victims:
            return
        pid = self.rng.choice(sorted(victims))
        try:
            if self.nproc > 1 and self.trainer is not None and pid == self.trainer.pid:
                kill_tree(pid)
            elif kind == "rank":
                os.kill(pid, signal.SIGTERM)
                self.trainer_termed = True
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, psutil.NoSuchProcess):
            return
        self.killed.add(pid)
        r.kills.append((now, kind, pid))

    def candidates(self, kind: str, now: float, min_age: float) -> list[int]:
        if kind == "trainer":
            ok = (
                self.trainer is not None
                and self.trainer.poll() is None
                and now - self.trainer_started >= min_age
            )
            return [self.trainer.pid] if ok else []
        if kind == "rank":
            out = []
            for pid in self.ranks():
                try:
                    if now - psutil.Process(pid).create_time() >= min_age:
                        out.append(pid)
                except psutil.NoSuchProcess:
                    pass
            return out
        if kind == "supervisor":
            return [p.pid for p, _, t in self.extracts if p.poll() is None and now - t >= min_age]
        out = []
        for w in self.workers():
            try:
                if now - w.create_time() >= min_age:
                    out.append(w.pid)
            except psutil.NoSuchProcess:
                pass
        return out

    def stop_all(self) -> None:
        procs = [p for p, _, _ in self.extracts] + ([self.trainer] if self.trainer else [])
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def kill_tree(pid: int) -> None:
    """kill -9 of a process and every descendant (stopped first, so none is spawned meanwhile)."""
    root = psutil.Process(pid)
    root.suspend()
    procs = root.children(recursive=True) + [root]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
