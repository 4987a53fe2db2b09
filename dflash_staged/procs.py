"""Process identity: (host, pid, start time), since pids are reused; the host's boot id; process lifetime;
a process's descendants.

The manifest records it for claims and for running extract/train processes; a claim or a
process is dead when its pid is gone, reused (another start time) or a zombie, or when it was
recorded on this host name in another boot (:data:`BOOT_ID`, ``/proc/sys/kernel/random/boot_id``:
the host rebooted since). Liveness can only be proven on the same host: elsewhere a claim waits
for its lease to expire.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket

# This machine's name in the manifest: its host name, or DFLASH_NODE_NAME (one name per machine: two
# machines under one name would read each other's pids; tests simulate nodes on one machine with it).
HOST = os.environ.get("DFLASH_NODE_NAME") or socket.gethostname()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


BOOT_ID = _boot_id()  # changes at every boot: with HOST, a host identity that survives reboots


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (Linux /proc), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])  # field 22 overall; fields after the ")" start at field 3


MY_PID = os.getpid()


def my_identity() -> tuple[str, int, int]:
    pid = os.getpid()
    return HOST, pid, process_start_time(pid) or 0


def pid_alive(host: str | None, pid: int | None, start: int | None, boot_id: str | None = None) -> bool:
    """True unless we can prove the process is gone (only provable on this host; a ``boot_id``
    other than this boot's proves it: the host rebooted since)."""
    if host != HOST or pid is None:
        return True
    if boot_id and BOOT_ID and boot_id != BOOT_ID:
        return False
    now_start = process_start_time(pid)
    if now_start is None:
        return False
    if start and now_start != start:
        return False  # pid reused by another process
    try:  # a zombie still has /proc; treat it as dead
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode(errors="replace").rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Linux: deliver ``sig`` to this process when its parent dies (PR_SET_PDEATHSIG); no-op elsewhere.

    Returns False when ``parent`` (the pid the caller knows started it) is no longer its parent:
    it died before the request took effect, so no signal will come and the caller should exit.
    (The signal follows the parent *thread* that started this process.)"""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    return parent is None or os.getppid() == parent


def descendants(pid: int) -> list[int]:
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
