"""Child processes under one supervisor: start, two-stage stop, signals forwarded, reap, exit codes.

Extract's and regenerate's workers (``multiprocessing`` children) and the launcher's stages
(commands) are supervised through this module:

* A :class:`Child` is one child process, started when it is made: :class:`SpawnedChild` runs a
  function in a ``multiprocessing`` process; :class:`CommandChild` runs a command in its own
  session with ``PR_SET_PDEATHSIG = SIGTERM`` (it stops cleanly if its supervisor dies), stdin
  closed, and stdout and stderr merged into lines handed to a callback.
  :meth:`~Child.poll` records how it ended: ``code`` (the OS's: ``-N`` when signal N killed it)
  and when; :meth:`~Child.exit_code` says it as a shell does (``128 + N``).
  :meth:`~Child.stop` asks it to stop (SIGTERM; a command's whole process group) and
  :meth:`~Child.kill` kills it (SIGKILL; a command's process group and every descendant, even
  once the command itself has exited). Either marks it ``stopped``: then its exit is not
  ``failed``.
* :class:`Children` are the children of one supervisor (a function that lists them, so they may
  change, e.g. a restarted worker). :meth:`~Children.stop` stops them in two stages: the first
  call asks each to stop, every later one kills them (:meth:`~Children.catch_up` does the same
  to children started since). ``with children.forwarding(SIGINT, SIGTERM)``, each such signal
  is recorded in ``signals`` and makes that call (only from the main thread; a signal this
  process ignores, e.g. SIGHUP under nohup, stays ignored; the old handlers come back on
  leaving). :meth:`~Children.close` reaps: the children still running are asked to stop and get
  ``grace`` seconds, then every child is killed and waited for.
* :class:`Progress`: a stage's progress line on stderr.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import click

from dflash_staged.procs import descendants, die_with_parent

REAP_S = 5.0  # how long a killed child is waited for


class Child:
    """One child process (see the module docstring). A kind of child provides ``pid`` and the four
    primitives below; a primitive that finds the process gone does nothing."""

    pid: int

    def __init__(self, name: str):
        self.name = name
        self.code: int | None = None  # once it has exited: its exit code, -N when killed by signal N
        self.stopped = False  # its supervisor asked it to stop, or killed it
        self.t0, self.t1 = time.monotonic(), None

    def _returncode(self) -> int | None:  # without blocking
        raise NotImplementedError

    def _terminate(self) -> None:
        raise NotImplementedError

    def _kill(self) -> None:
        raise NotImplementedError

    def _wait(self, timeout: float | None) -> None:
        raise NotImplementedError

    def poll(self) -> int | None:
        """Its exit code once it has exited (recorded then, with the time), else None."""
        if self.code is None:
            code = self._returncode()
            if code is not None:
                self.code, self.t1 = code, time.monotonic()
        return self.code

    def alive(self) -> bool:
        return self.poll() is None

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds (None: for as long as it runs); :meth:`poll`'s answer."""
        if self.code is None:
            self._wait(timeout)
        return self.poll()

    def stop(self) -> None:
        """Ask it to stop: SIGTERM, once (nothing once it is known to have exited)."""
        if self.code is None and not self.stopped:
            self.stopped = True
            self._terminate()

    def kill(self) -> None:
        """SIGKILL."""
        if self.code is None:
            self.stopped = True
        self._kill()

    @property
    def failed(self) -> bool:
        """It exited with an error, and not because its supervisor stopped it."""
        return self.code not in (None, 0) and not self.stopped

    def seconds(self) -> float:
        """How long it ran (so far)."""
        return (self.t1 or time.monotonic()) - self.t0

    def exit_code(self) -> int:
        """Its exit code as a shell says it: 128 + N when signal N killed it (1 while it runs)."""
        c = self.code if self.code is not None else 1
        return 128 - c if c < 0 else c


class SpawnedChild(Child):
    """``target(*args)`` in a process of the multiprocessing context ``ctx`` (e.g. spawn)."""

    def __init__(self, ctx, name: str, target, args: tuple):
        super().__init__(name)
        self.process = ctx.Process(target=target, args=args, name=name, daemon=False)
        self.process.start()
        self.pid = self.process.pid

    def _returncode(self) -> int | None:
        return self.process.exitcode

    def _terminate(self) -> None:
        self.process.terminate()

    def _kill(self) -> None:
        self.process.kill()

    def _wait(self, timeout: float | None) -> None:
        self.process.join(timeout)


def _die_with_supervisor() -> None:  # runs in the command's process between fork and exec
    die_with_parent(signal.SIGTERM)


class CommandChild(Child):
    """``cmd`` with environment ``env``, its own session, each output line given to ``on_line`` (the
    last redraw of a ``\\r`` line) by the thread ``reader``, which the caller starts once every
    command is started (``preexec_fn`` must not run while this process runs other threads)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], on_line: Callable[[str], None]):
        super().__init__(name)
        self.p = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_supervisor if sys.platform == "linux" else None,
        )
        self.pid = self.p.pid
        self.reader = threading.Thread(target=self._read, args=(on_line,), daemon=True, name=f"read-{name}")

    def _read(self, on_line: Callable[[str], None]) -> None:
        for raw in iter(self.p.stdout.readline, b""):
            on_line(raw.decode(errors="replace").rstrip("\r\n").rsplit("\r", 1)[-1])

    def _returncode(self) -> int | None:
        return self.p.poll()

    def _killpg(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _terminate(self) -> None:
        self._killpg(signal.SIGTERM)

    def _kill(self) -> None:
        # every descendant (torchrun's ranks have sessions of their own), collected before anything dies
        for pid in descendants(self.pid) if self.p.poll() is None else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._killpg(signal.SIGKILL)

    def _wait(self, timeout: float | None) -> None:
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class Children:
    """The children of one supervisor, as ``members()`` lists them now (see the module docstring)."""

    def __init__(self, members: Callable[[], Iterable[Child]]):
        self.members = members
        self.stops = 0  # calls of stop(): the first asked the children to stop, later ones killed them
        self.signals: list[int] = []  # the signals forwarded, in order

    @property
    def stopping(self) -> bool:
        return self.stops > 0

    def stop(self) -> None:
        """First call: ask every child to stop; later calls: kill them."""
        self.stops += 1
        self.catch_up()

    def catch_up(self) -> None:
        """Apply the stops so far to every child, also one started since (a signal while it started)."""
        for c in list(self.members()) if self.stops else []:
            if self.stops == 1:
                c.stop()
            else:
                c.kill()

    @contextmanager
    def forwarding(self, *signums: int) -> Iterator[Children]:
        """Within: each of these signals is recorded and stops the children (:meth:`stop`)."""

        def on_signal(signum, _frame):
            self.signals.append(signum)
            self.stop()

        old = {}
        if threading.current_thread() is threading.main_thread():
            old = {
                s: signal.signal(s, on_signal) for s in signums if signal.getsignal(s) is not signal.SIG_IGN
            }
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def close(self, grace: float) -> None:
        """Reap: the children still running are asked to stop and get ``grace`` seconds in all; then
        each child is killed (a command's leftover descendants too) and waited for."""
        running = [c for c in self.members() if c.alive()]
        if grace > 0 and running:
            for c in running:
                c.stop()
            deadline = time.monotonic() + grace
            for c in running:
                c.wait(max(0.0, deadline - time.monotonic()))
        for c in list(self.members()):
            c.poll()
            c.kill()
            c.wait(REAP_S)


class Progress:
    """A stage's progress line: on a terminal, a bar on stderr (``total`` steps) redrawn at each
    :meth:`show` with the line as its label; elsewhere ``"{label}: {line}"`` on stderr, at most
    every ``every`` seconds (the first at once)."""

    def __init__(self, label: str, total: int, every: float = 5.0):
        self.label, self.every, self.last = label, every, None
        self.bar = (
            click.progressbar(length=total, label=label, show_pos=True, file=sys.stderr)
            if sys.stderr.isatty()
            else None
        )

    def show(self, pos: int, line: str) -> None:
        if self.bar is not None:
            self.bar.pos, self.bar.label = pos, line
            self.bar.render_progress()
        elif self.last is None or time.monotonic() - self.last > self.every:
            click.echo(f"{self.label}: {line}", err=True)
            self.last = time.monotonic()
