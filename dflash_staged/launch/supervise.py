"""Run ``plan`` (if needed), then ``extract`` and ``train`` side by side under one supervisor.

``dflash pipeline`` (any machine) and ``dflash node`` (one GPU node split between the stages)
build their commands in :mod:`dflash_staged.launch.processes`; this module's
:func:`run_side_by_side` runs and supervises them. Work directory layout::

    WORKDIR/manifest   the plan (``dflash plan``; planned only when it does not exist yet)
    WORKDIR/store      the shard store (``dflash extract`` writes, ``dflash train`` reads/deletes)
    WORKDIR/run        the training run (checkpoints, ``metrics.jsonl``)

Supervision contract of :func:`run_side_by_side`:

* Each child runs in its own session / process group with ``PR_SET_PDEATHSIG = SIGTERM``, so it
  stops (cleanly) if the launcher dies; on the launcher's exit whatever is left of a child's
  process tree is killed (:class:`~dflash_staged.children.CommandChild`). ``stdin`` is closed;
  stdout and stderr are merged and every line is printed prefixed ``[plan]``, ``[extract]`` or
  ``[train]``. The launcher's own lines start ``[launch]``: a combined status every
  ``status_every`` seconds (jobs extracted / trained, window shards and bytes, store bytes now
  and peak) and a summary at the end.
* Signals: the first SIGINT / SIGTERM / SIGHUP sends SIGTERM to both process groups (a clean
  stop: train checkpoints, extract finishes or gives back its jobs); a second one SIGKILLs both
  process trees. The launcher then exits 128 + the first signal (130 for Ctrl-C).
* Failures: when **train** exits for any reason, extract gets ``extract_grace_s`` to leave on its
  own (it does once nothing is left and no trainer is alive), then SIGTERM; train's non-zero exit
  code is the launcher's. When **extract** fails, train is left to *drain*: it trains on the
  shards already written, checkpoints, and stops by itself (``dflash train`` ends with an error
  once jobs remain that no extractor will write). The launcher stops train early (SIGTERM) if
  the store was never created or the manifest shows no progress for ``stall_s`` seconds. Its
  exit code is extract's. A child that exits because the launcher stopped it is not a failure.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_staged.children import Children, CommandChild
from dflash_staged.launch.monitor import Monitor, summary

POLL_S = 0.2
PY = sys.executable
# The last of the time lines `dflash extract` closes with (manifest.balance.format_balance): once extract
# has printed them, the summary does not print the same four lines again.
EXTRACT_BALANCE = "extract: bottleneck (whole run): "


@dataclass
class Proc:
    """One process to start: a name (the output prefix), its command, and env vars set on top of ours."""

    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.cmd)


def run_side_by_side(
    plan_cmd: list[str] | None,
    extract_cmd: list[str],
    train_cmd: list[str],
    env_extract: dict[str, str] | None = None,
    env_train: dict[str, str] | None = None,
    *,
    manifest: Path | None = None,
    store: Path | None = None,
    run_dir: Path | None = None,
    status_every: float = 10.0,
    stall_s: float = 120.0,
    extract_grace_s: float = 15.0,
    summary_path: Path | None = None,
    after_plan=None,
    dry_run: bool = False,
    out=None,
) -> int:
    """Run `plan_cmd` (if given) to completion, then `extract_cmd` and `train_cmd` side by side.

    Any commands work (tests use small fake ones). `env_*` are set on top of this process's
    environment. manifest/store/run_dir only feed the status line and the summary;
    `after_plan()` runs between planning and the start of extract/train (e.g. to print what the
    plan implies). Returns the exit code (see the module docstring); with dry_run, prints the
    processes it would start and returns 0.
    """
    out = out or sys.stdout
    plan = Proc("plan", plan_cmd) if plan_cmd else None
    ex = Proc("extract", extract_cmd, dict(env_extract or {}))
    tr = Proc("train", train_cmd, dict(env_train or {}))
    if dry_run:
        for p in [plan, ex, tr] if plan else [ex, tr]:
            print(f"[dry-run] {p.name}: {p.describe()}", file=out, flush=True)
        return 0
    launch = _Launch(out, store, status_every=status_every, stall_s=stall_s, extract_grace_s=extract_grace_s)
    # (signals ignored on purpose, e.g. SIGHUP under nohup, stay so)
    with launch.children.forwarding(signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        launch.mon = Monitor(manifest, store, run_dir)
        try:
            t_start, plan_s = time.monotonic(), 0.0
            if plan is not None:
                code, plan_s = launch.plan(plan)
                if code is not None:
                    return code
            if after_plan is not None:
                after_plan()
            code, ex_child, tr_child = launch.side_by_side(ex, tr)
            summary(
                launch.say,
                launch.mon,
                code,
                plan_s,
                ex_child,
                tr_child,
                time.monotonic() - t_start,
                summary_path,
                balance=not launch.extract_said_balance,
                stopped=bool(launch.children.signals),
            )
            return code
        finally:
            launch.children.close(grace=0)  # a finished child's leftovers, or a child running after an error
            launch.mon.close()


class _Launch:
    """One run of :func:`run_side_by_side`: its children, its output, the signals it got."""

    def __init__(
        self, out, store: Path | None, *, status_every: float, stall_s: float, extract_grace_s: float
    ):
        self.out, self.lock = out, threading.RLock()
        self.store = store
        self.status_every, self.stall_s, self.extract_grace_s = status_every, stall_s, extract_grace_s
        self.running: dict[str, CommandChild] = {}
        self.children = Children(lambda: list(self.running.values()))
        self.mon: Monitor | None = None
        self.signals_said = 0
        self.extract_said_balance = False  # extract printed its closing time lines

    def say(self, text: str, who: str = "launch") -> None:
        with self.lock:
            print(f"[{who}] {text}", file=self.out, flush=True)

    def report_signals(self) -> None:
        """Say the signals received so far (never from the signal handler itself)."""
        sigs = self.children.signals
        while self.signals_said < len(sigs):
            name = signal.Signals(sigs[self.signals_said]).name
            self.say(
                f"{name}: "
                + (
                    "stopping cleanly (train checkpoints); send it again to kill"
                    if self.signals_said == 0
                    else "killing every child process"
                )
            )
            self.signals_said += 1

    def start(self, proc: Proc) -> CommandChild:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **proc.env}

        def relay(line: str) -> None:
            if proc.name == "extract" and line.startswith(EXTRACT_BALANCE):
                self.extract_said_balance = True
            self.say(line, proc.name)

        c = CommandChild(proc.name, proc.cmd, env, relay)
        self.running[proc.name] = c
        return c

    def plan(self, proc: Proc) -> tuple[int | None, float]:
        """Run the plan to completion: (None, its seconds) once it succeeded, else (the exit code, ...)."""
        self.say("planning: " + proc.describe())
        c = self.start(proc)
        c.reader.start()
        while c.alive():
            time.sleep(POLL_S)
            self.report_signals()
        c.reader.join(timeout=5)
        self.report_signals()
        if self.children.signals:
            return 128 + self.children.signals[0], c.seconds()
        if c.code != 0:
            self.say(f"plan failed (exit {c.exit_code()}); nothing else was started")
            return c.exit_code(), c.seconds()
        del self.running["plan"]
        return None, c.seconds()

    def side_by_side(self, ex_proc: Proc, tr_proc: Proc) -> tuple[int, CommandChild, CommandChild]:
        """Run extract and train until both have exited: (the exit code, extract, train)."""
        for p in (ex_proc, tr_proc):
            self.say(f"starting {p.name}: {p.describe()}")
        # Both start before their reader threads, so preexec_fn never runs alongside our other threads.
        ex, tr = self.start(ex_proc), self.start(tr_proc)
        self.children.catch_up()  # a signal that arrived while they were starting
        ex.reader.start(), tr.reader.start()
        last_status = time.monotonic()
        drain = _Drain(self, ex, tr)
        while ex.alive() | tr.alive():
            time.sleep(POLL_S)
            self.report_signals()
            ex.poll(), tr.poll()
            now = time.monotonic()
            if (
                tr.code is not None
                and ex.code is None
                and not ex.stopped
                and (tr.failed or now - tr.t1 > self.extract_grace_s)
            ):
                self.say(f"train exited ({tr.exit_code()}); stopping extract")
                ex.stop()
            if ex.failed and tr.code is None and not tr.stopped:
                drain.check(now)
            self.mon.sample_store()
            if now - last_status >= self.status_every:
                line = self.mon.line()
                if line:
                    self.say(line)
                last_status = now
        for c in (ex, tr):
            c.reader.join(timeout=5)
        self.report_signals()
        if self.children.signals:
            return 128 + self.children.signals[0], ex, tr
        return (tr.exit_code() if tr.failed else ex.exit_code() if ex.failed else 0), ex, tr


class _Drain:
    """Extract failed and train drains: stop train when there is no store, or no progress for ``stall_s``."""

    def __init__(self, launch: _Launch, ex: CommandChild, tr: CommandChild):
        self.launch, self.ex, self.tr = launch, ex, tr
        self.said, self.last_check = False, 0.0
        self.progress, self.progress_t = None, time.monotonic()  # the manifest's last state, and since when

    def check(self, now: float) -> None:
        la = self.launch
        if self.said and now - self.last_check < 1.0:
            return
        self.last_check = now
        if not self.said:
            la.say(
                f"extract failed (exit {self.ex.exit_code()}); train goes on with the shards already "
                "written and stops by itself (Ctrl-C stops it now)"
            )
            self.said = True
        st = la.mon.status()
        progress = None if st is None else (st["jobs"], st["window"])
        if progress != self.progress:
            self.progress, self.progress_t = progress, now
        if la.store is not None and not Path(la.store).exists():
            la.say(f"no store at {la.store}: nothing to train on; stopping train")
            self.tr.stop()
        elif now - self.progress_t > la.stall_s:
            la.say(f"no progress in the manifest for {la.stall_s:.0f} s since extract failed; stopping train")
            self.tr.stop()
