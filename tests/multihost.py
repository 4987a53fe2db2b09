"""Several hosts on one machine, for the multi-host tests.

A simulated host is a network namespace joined to this one by a veth pair (10.231.K.1 on this side,
10.231.K.2 inside) and a UTS namespace of its own, so its processes have their own host name and
reach the database only through their link; every host shares the filesystem (the shared store).
``partition()`` takes the link down (connections from inside stall and time out), ``heal()`` brings
it back, ``kill_all()`` SIGKILLs every process inside (a host lost whole). Needs root (``ip netns``).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from helpers import ROOT


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Host:
    def __init__(self, name: str, ns: str, veth: str, octet: int):
        self.name, self.ns, self.veth = name, ns, veth
        self.here, self.there = f"10.231.{octet}.1", f"10.231.{octet}.2"

    def create(self) -> Host:
        inner = self.veth.replace("dh", "dn", 1)
        _ip("netns", "add", self.ns)
        try:
            _ip("link", "add", self.veth, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", self.ns)
            _ip("addr", "add", f"{self.here}/30", "dev", self.veth)
            _ip("link", "set", self.veth, "up")
            _ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.there}/30", "dev", inner)
            _ip("netns", "exec", self.ns, "ip", "link", "set", inner, "up")
            _ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def url(self, pg, name: str) -> str:
        """The manifest's address as this host reaches the server."""
        return pg.url(name, host=self.here)

    def start(self, args: list, log: Path, environ: dict) -> subprocess.Popen:
        """`python -m dflash_staged ARGS` on this host, output appended to ``log``."""
        f = open(log, "a")
        f.write(f"$ [{self.name}] dflash {' '.join(map(str, args))}\n")
        f.flush()
        cmd = [
            "ip",
            "netns",
            "exec",
            self.ns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname {self.name} && exec "$0" "$@"',
            sys.executable,
            "-m",
            "dflash_staged",
            *map(str, args),
        ]
        p = subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=f, stderr=subprocess.STDOUT, text=True)
        f.close()
        return p

    def partition(self) -> None:
        _ip("link", "set", self.veth, "down")

    def heal(self) -> None:
        _ip("link", "set", self.veth, "up")

    def pids(self) -> list[int]:
        r = _ip("netns", "pids", self.ns, check=False)
        return [int(x) for x in r.stdout.split()]

    def kill_all(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send `sig` (SIGKILL, or SIGSTOP / SIGCONT to freeze and thaw) to every process here."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def destroy(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", self.ns, check=False)  # takes its end of the veth pair, and so the pair, with it
        _ip("link", "del", self.veth, check=False)


def can_rename_host() -> str | None:
    """None if `unshare --uts` works here (root), else why not."""
    r = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"unshare --uts: {r.stderr.strip() or r.returncode}"


def make_hosts(names: list[str]) -> list[Host]:
    """Hosts on /30 subnets of 10.231.0.0/16 that no interface here uses yet."""
    used = _ip("-o", "-4", "addr").stdout
    free = [k for k in range(1, 255) if f"10.231.{k}." not in used]
    rng = random.Random(os.getpid())
    octets = rng.sample(free, len(names))
    tag = f"{os.getpid() % 100000}"
    hosts = []
    try:
        for i, (name, k) in enumerate(zip(names, octets)):
            hosts.append(Host(name, f"dflash-{tag}-{i}", f"dh{tag}x{i}", k).create())
    except BaseException:
        for h in hosts:
            h.destroy()
        raise
    return hosts
