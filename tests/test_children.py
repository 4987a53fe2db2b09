"""The supervision helper (dflash_staged.children), with real processes: the two-stage stop and its
grace, exit codes, signals forwarded to a stop, and the kill of a command's whole process tree."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time

import pytest

from dflash_staged.children import Children, CommandChild, SpawnedChild

CTX = mp.get_context("spawn")  # as extract and regenerate start their workers


def _ignore_sigterm(ready) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(120)


def _sleep(ready) -> None:
    ready.set()
    time.sleep(120)


def _exit(code: int) -> None:
    sys.exit(code)


def spawned(target, *args) -> SpawnedChild:
    return SpawnedChild(CTX, target.__name__, target, args)


def started(target) -> SpawnedChild:
    """A child running ``target``, once it has set its signal handlers."""
    ready = CTX.Event()
    c = spawned(target, ready)
    assert ready.wait(60)
    return c


def test_a_child_ignoring_sigterm_is_killed_once_the_grace_is_over():
    c = started(_ignore_sigterm)
    t0 = time.monotonic()
    Children(lambda: [c]).close(grace=0.5)
    took = time.monotonic() - t0
    assert 0.5 <= took < 10, took
    assert c.code == -signal.SIGKILL and c.exit_code() == 128 + signal.SIGKILL
    assert c.stopped and not c.failed


def test_a_child_that_stops_on_sigterm_ends_within_the_grace():
    c = started(_sleep)
    t0 = time.monotonic()
    Children(lambda: [c]).close(grace=30)
    assert time.monotonic() - t0 < 10
    assert c.code == -signal.SIGTERM and c.exit_code() == 128 + signal.SIGTERM and not c.failed


def test_exit_codes_and_failures():
    ok, bad = spawned(_exit, 0), spawned(_exit, 3)
    assert ok.wait(60) == 0 and bad.wait(60) == 3
    assert not ok.failed and bad.failed and bad.exit_code() == 3 and bad.seconds() > 0
    assert not ok.alive() and ok.t1 is not None
    lines: list[str] = []
    script = "echo one; printf 'x\\rtwo\\n'; exit 4"
    cmd = CommandChild("sh", ["sh", "-c", script], dict(os.environ), lines.append)
    cmd.reader.start()
    assert cmd.wait(60) == 4 and cmd.failed
    cmd.reader.join(10)
    assert lines == ["one", "two"]  # a \r line: its last redraw


def test_signals_are_forwarded_as_a_two_stage_stop():
    c = started(_ignore_sigterm)
    children = Children(lambda: [c])
    before = signal.getsignal(signal.SIGTERM)
    with children.forwarding(signal.SIGTERM):
        assert signal.getsignal(signal.SIGTERM) is not before  # (else the next line would end this test run)
        os.kill(os.getpid(), signal.SIGTERM)
        assert children.signals == [signal.SIGTERM] and children.stopping and c.stopped
        assert c.wait(0.5) is None  # it ignores the first stage
        os.kill(os.getpid(), signal.SIGTERM)
        assert c.wait(30) == -signal.SIGKILL
    assert signal.getsignal(signal.SIGTERM) is before
    assert len(children.signals) == 2 and children.stops == 2


def test_an_ignored_signal_stays_ignored():
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with Children(list).forwarding(signal.SIGHUP):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


def test_a_child_started_after_a_stop_catches_up():
    members: list = []
    children = Children(lambda: members)
    children.stop()  # e.g. a signal while the children were starting
    members.append(started(_sleep))
    children.catch_up()
    assert members[0].wait(30) == -signal.SIGTERM and members[0].stopped


GRANDCHILD = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(g.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="descendants are found in /proc")
def test_killing_a_command_kills_its_descendants_in_other_sessions():
    lines: list[str] = []
    c = CommandChild("tree", [sys.executable, "-c", GRANDCHILD], dict(os.environ), lines.append)
    c.reader.start()
    deadline = time.monotonic() + 60
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(lines[0])
    c.stop()  # ignored
    assert c.wait(0.3) is None
    Children(lambda: [c]).close(grace=0.2)
    assert c.code == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
