"""Run ``plan`` (if needed), then ``extract`` and ``train`` side by side under one supervisor.

``dflash pipeline`` (any machine) and ``dflash node`` (one GPU node split between the stages)
build their commands in :mod:`dflash_staged.launch.layout`; this module's
:func:`run_side_by_side` runs and supervises them. Work directory layout::

    WORKDIR/manifest   the plan (``dflash plan``; planned only when it does not exist yet)
    WORKDIR/store      the shard store (``dflash extract`` writes, ``dflash train`` reads/deletes)
    WORKDIR/run        the training run (checkpoints, ``metrics.jsonl``)

Supervision contract of :func:`run_side_by_side`:

* Each child runs in its own session / process group with ``PR_SET_PDEATHSIG = SIGTERM``, so it
  stops (cleanly) if the launcher dies; on the launcher's exit whatever is left of a child's
  process tree is killed. ``stdin`` is closed; stdout and stderr are merged and every line is
  printed prefixed ``[plan]``, ``[extract]`` or ``[train]``. The launcher's own lines start
  ``[launch]``: a combined status every ``status_every`` seconds (jobs extracted / trained,
  window shards and bytes, store bytes now and peak) and a summary at the end.
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
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_staged.procs import die_with_parent
from dflash_staged.launch.monitor import Monitor, summary

POLL_S = 0.2
PY = sys.executable


def _descendants(pid: int) -> list[int]:
    """Pids of every live descendant of `pid` (Linux /proc; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for e in entries:
        try:
            with open(f"/proc/{e}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@dataclass
class Proc:
    """One process to start: a name (the output prefix), its command, and env vars set on top of ours."""
    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.cmd)


def _die_with_launcher() -> None:  # runs in the child between fork and exec
    die_with_parent(signal.SIGTERM)


class _Child:
    def __init__(self, proc: Proc, say):
        self.name, self.say = proc.name, say
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **proc.env}
        self.p = subprocess.Popen(proc.cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, start_new_session=True,
                                  preexec_fn=_die_with_launcher if sys.platform == "linux" else None)
        self.t0, self.t1 = time.monotonic(), None
        self.code: int | None = None
        self.stopped = False  # the launcher asked it to stop (so its exit is not a failure)
        self.reader = threading.Thread(target=self._read, daemon=True, name=f"read-{self.name}")

    def _read(self) -> None:
        for raw in iter(self.p.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n").rsplit("\r", 1)[-1]  # last redraw of a \r line
            self.say(line, self.name)

    def poll(self) -> bool:
        """True while running; records the exit code and time once it has exited."""
        if self.code is None and self.p.poll() is not None:
            self.code, self.t1 = self.p.returncode, time.monotonic()
        return self.code is None

    @property
    def failed(self) -> bool:
        return self.code is not None and self.code != 0 and not self.stopped

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if sig == signal.SIGKILL:
            self.kill_tree()
            return
        if self.code is None:
            self.stopped = True
            try:
                os.killpg(self.p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill_tree(self) -> None:
        """SIGKILL the child's process group and every descendant (torchrun ranks have their own sessions)."""
        running = self.p.poll() is None
        if self.code is None:
            self.stopped = True
        for pid in (_descendants(self.p.pid) if running else []):  # collected before anything dies
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def seconds(self) -> float:
        return (self.t1 or time.monotonic()) - self.t0

    def exit_code(self) -> int:
        c = self.code if self.code is not None else 1
        return 128 - c if c < 0 else c  # killed by signal N -> 128 + N


def run_side_by_side(plan_cmd: list[str] | None, extract_cmd: list[str], train_cmd: list[str],
                     env_extract: dict[str, str] | None = None, env_train: dict[str, str] | None = None, *,
                     manifest: Path | None = None, store: Path | None = None, run_dir: Path | None = None,
                     status_every: float = 10.0, stall_s: float = 120.0, extract_grace_s: float = 15.0,
                     summary_path: Path | None = None, after_plan=None, dry_run: bool = False, out=None) -> int:
    """Run `plan_cmd` (if given) to completion, then `extract_cmd` and `train_cmd` side by side.

    Any commands work (tests use small fake ones). `env_*` are set on top of this process's
    environment. manifest/store/run_dir only feed the status line and the summary;
    `after_plan()` runs between planning and the start of extract/train (e.g. to print what the
    plan implies). Returns the exit code (see the module docstring); with dry_run, prints the
    processes it would start and returns 0.
    """
    out = out or sys.stdout
    lock = threading.RLock()
    procs = ([Proc("plan", plan_cmd)] if plan_cmd else []) + \
        [Proc("extract", extract_cmd, dict(env_extract or {})), Proc("train", train_cmd, dict(env_train or {}))]
    if dry_run:
        for p in procs:
            print(f"[dry-run] {p.name}: {p.describe()}", file=out, flush=True)
        return 0

    def say(text: str, who: str = "launch") -> None:
        with lock:
            print(f"[{who}] {text}", file=out, flush=True)

    children: dict[str, _Child] = {}
    sigs: list[int] = []  # signals received, in order; reported by the main loop (no printing in a handler)

    def on_signal(signum, _frame):
        sigs.append(signum)
        for c in list(children.values()):
            c.stop(signal.SIGKILL if len(sigs) > 1 else signal.SIGTERM)

    old = {}
    if threading.current_thread() is threading.main_thread():  # (signals ignored on purpose, e.g. nohup, stay so)
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
               if signal.getsignal(s) is not signal.SIG_IGN}
    mon = Monitor(manifest, store, run_dir)
    said = [0]

    def report_signals() -> None:
        while said[0] < len(sigs):
            name = signal.Signals(sigs[said[0]]).name
            say(f"{name}: " + ("stopping cleanly (train checkpoints); send it again to kill" if said[0] == 0
                               else "killing every child process"))
            said[0] += 1

    t_start = time.monotonic()
    plan_s = 0.0
    try:
        if plan_cmd:
            say("planning: " + procs[0].describe())
            c = children["plan"] = _Child(procs[0], say)
            c.reader.start()
            while c.poll():
                time.sleep(POLL_S)
                report_signals()
            c.reader.join(timeout=5)
            plan_s = c.seconds()
            report_signals()
            if sigs:
                return 128 + sigs[0]
            if c.code != 0:
                say(f"plan failed (exit {c.exit_code()}); nothing else was started")
                return c.exit_code()
            del children["plan"]
        if after_plan is not None:
            after_plan()
        for p in procs[-2:]:
            say(f"starting {p.name}: {p.describe()}")
        # Both start before their reader threads, so preexec_fn never runs alongside our other threads.
        ex = children["extract"] = _Child(procs[-2], say)
        tr = children["train"] = _Child(procs[-1], say)
        if sigs:  # a signal that arrived while they were starting
            ex.stop(), tr.stop()
        ex.reader.start(), tr.reader.start()
        last_status = progress_t = last_check = time.monotonic()
        progress_sig, drain_said = None, False
        while ex.poll() | tr.poll():
            time.sleep(POLL_S)
            report_signals()
            ex.poll(), tr.poll()
            now = time.monotonic()
            if tr.code is not None and ex.code is None and not ex.stopped \
                    and (tr.failed or now - tr.t1 > extract_grace_s):
                say(f"train exited ({tr.exit_code()}); stopping extract")
                ex.stop()
            if ex.failed and tr.code is None and not tr.stopped and (not drain_said or now - last_check >= 1.0):
                last_check = now
                if not drain_said:
                    say(f"extract failed (exit {ex.exit_code()}); train goes on with the shards already written "
                        "and stops by itself (Ctrl-C stops it now)")
                    drain_said = True
                st = mon.status()
                sig = None if st is None else (st["jobs"], st["window"])
                if sig != progress_sig:
                    progress_sig, progress_t = sig, now
                if store is not None and not Path(store).exists():
                    say(f"no store at {store}: nothing to train on; stopping train")
                    tr.stop()
                elif now - progress_t > stall_s:
                    say(f"no progress in the manifest for {stall_s:.0f} s since extract failed; stopping train")
                    tr.stop()
            mon.sample_store()
            if now - last_status >= status_every:
                line = mon.line()
                if line:
                    say(line)
                last_status = now
        for c in (ex, tr):
            c.reader.join(timeout=5)
        report_signals()
        if sigs:
            code = 128 + sigs[0]
        elif tr.failed:
            code = tr.exit_code()
        elif ex.failed:
            code = ex.exit_code()
        else:
            code = 0
        summary(say, mon, code, plan_s, ex, tr, time.monotonic() - t_start, summary_path)
        return code
    finally:
        for c in children.values():
            c.poll()
            c.kill_tree()  # leftovers of a finished child, or a child still running after an exception
        for s, h in old.items():
            signal.signal(s, h)
        mon.close()
