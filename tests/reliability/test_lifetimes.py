"""Lifetimes: nothing outlives its launcher, and extract does not leave before its trainer came.

torchrun starts each rank in its own session, so before each rank asked to die with torchrun, a
``kill -9`` of `dflash train --nproc N` left the ranks training as orphans, and a restarted trainer
was refused ("another train ... already uses") until they finished. The stay rule of extract
(``should_stay``) waits for a trainer that may still be starting (see also test_corruption).
"""

from __future__ import annotations

import os
import signal
import time

import psutil

from dflash_staged.extract.options import ExtractOptions
from dflash_staged.extract.worker import should_stay
from dflash_staged.manifest import Manifest
from dflash_staged.procs import HOST, pid_alive, process_start_time

from helpers import env, plan, run, start

EXTRA = "[data]\ntoken_budget = 512\n"


def _alive(pids: dict[int, int]) -> list[int]:
    return [pid for pid, t in pids.items() if pid_alive(HOST, pid, t)]  # a zombie counts as gone


def test_train_ranks_die_with_a_killed_nproc_launcher(tmp_path):
    mdir = plan(tmp_path, n=8, extra=EXTRA)
    p = start(
        [
            "train",
            "--manifest",
            mdir,
            "--store",
            tmp_path / "store",
            "--out",
            tmp_path / "run",
            "--nproc",
            "2",
            "--device",
            "cpu",
        ],
        tmp_path / "train.log",
    )
    ranks: list = []
    deadline = time.time() + 240
    while len(ranks) < 2 and time.time() < deadline and p.poll() is None:  # both registered: past their start
        time.sleep(0.5)
        with Manifest.open(mdir, readonly=True) as m:
            ranks = m.live_procs("train")
    log = (tmp_path / "train.log").read_text()
    assert len(ranks) == 2, log
    tree = {c.pid: process_start_time(c.pid) for c in psutil.Process(p.pid).children(recursive=True)}
    assert {r.pid for r in ranks} <= set(tree), (ranks, tree)  # `dflash train` became torchrun (same pid)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    deadline = time.time() + 20
    while _alive(tree) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(tree), f"ranks outlived their killed launcher: {_alive(tree)}\n{log}"
    with Manifest.open(mdir, readonly=True) as m:
        assert m.live_procs("train") == []  # a restarted trainer is not refused


def test_a_rank_whose_torchrun_is_gone_stops_at_once(tmp_path):
    """The race: torchrun died before its rank asked to die with it (no signal would ever come)."""
    e = {**env(), "TORCHELASTIC_RUN_ID": "test", "WORLD_SIZE": "2", "DFLASH_TORCHRUN_PID": "1"}
    r = run(
        ["train", "--manifest", tmp_path / "m", "--store", tmp_path / "s", "--out", tmp_path / "o"],
        e,
        timeout=60,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "torchrun (pid 1) exited before this rank started; stopping" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


class _Manifest:
    def __init__(self, written: int):
        self.written, self.trainers = written, []

    def counts(self):
        return {"written": self.written, "consumed": 0}

    def live_procs(self, role):
        return self.trainers if role == "train" else []


def test_extract_waits_for_a_trainer_only_until_one_came():
    opts = ExtractOptions(
        manifest="m",
        store="s",
        devices=["cpu"],
        window=4,
        window_bytes=0,
        lease_s=1.0,
        max_attempts=1,
        trainer_deadline=time.time() + 60,
    )
    m = _Manifest(written=3)
    assert should_stay(m, opts) and not opts.trainer_seen  # one may be starting: wait
    m.trainers = ["trainer"]
    assert should_stay(m, opts) and opts.trainer_seen
    m.trainers = []
    assert not should_stay(m, opts)  # it came and went: leave, deadline or not
    fresh = ExtractOptions(
        manifest="m",
        store="s",
        devices=["cpu"],
        window=4,
        window_bytes=0,
        lease_s=1.0,
        max_attempts=1,
        trainer_deadline=time.time() - 1,
    )
    assert not should_stay(m, fresh)  # none came in time
    assert not should_stay(_Manifest(written=0), opts)  # nothing a trainer could send back
