"""Several hosts, one PostgreSQL manifest, one shared store (tests/multihost.py: namespaces).

Two extract hosts (each its own host name and network link to the database) and a trainer on this
host, over two epochs, with the fast fake target. Four runs: side by side to completion; one
extract host killed whole mid-run; one extract host cut off from the database while it holds
claims and writes, until its leases expired and other hosts redid its jobs; the database restarted
mid-run. Each must end with every job of every epoch used by exactly one optimizer step, nothing
left in the store, and the window never exceeded (sampled throughout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dflash_staged.manifest import Manifest

from helpers import plan, start
from rel_helpers import assert_all_released_and_clean, assert_exactly_once, hooked_env, scan_store, tracebacks

WINDOW = 8
LEASE_S = 2.0
EXTRA = f"[data]\ntoken_budget = 512\n[extract]\nlease_s = {LEASE_S}\n"
HIDDEN = 128  # the tiny target's: the trainer builds its drafter for it


@pytest.fixture(scope="module")
def hosts(pg):
    from multihost import make_hosts

    try:
        made = make_hosts(["host-a", "host-b"])
    except Exception as e:  # noqa: BLE001 - no root, no ip netns
        msg = f"cannot simulate hosts with ip netns: {e}"
        pytest.fail(msg) if os.environ.get("DFLASH_REQUIRE_POSTGRES") == "1" else pytest.skip(msg)
    pg.listen_on([h.here for h in made])
    yield {h.name: h for h in made}
    for h in made:
        h.destroy()
    pg.listen_on([])


@dataclass
class Run:
    tmp: Path
    pg: object
    hosts: dict
    delay: dict  # host name -> fake target seconds per job
    n: int = 40
    url: str = ""
    procs: dict = field(default_factory=dict)  # "train" | host name -> Popen
    max_window: int = 0

    def __post_init__(self):
        self.name = self.pg.url().rsplit("#", 1)[1]
        self.url = plan(self.tmp, n=self.n, epochs=2, extra=EXTRA, manifest=self.pg.url(self.name))
        self.store, self.run_dir = self.tmp / "store", self.tmp / "run"
        self.m = Manifest.open(self.url, readonly=True)
        self.total = sum(self.m.counts().values())

    def start(self) -> None:
        for name, h in self.hosts.items():
            env = hooked_env(fake_target={"hidden": HIDDEN, "delay_s": self.delay[name]})
            self.procs[name] = h.start(
                [
                    "extract",
                    "--manifest",
                    h.url(self.pg, self.name),
                    "--store",
                    self.store,
                    "--devices",
                    "cpu",
                    "--window",
                    WINDOW,
                ],
                self.tmp / f"{name}.log",
                env,
            )
        self.procs["train"] = start(
            ["train", "--manifest", self.url, "--store", self.store, "--out", self.run_dir],
            self.tmp / "train.log",
            hooked_env(fake_target={"hidden": HIDDEN}),
        )

    def sample(self) -> dict:
        c = self.m.counts()
        self.max_window = max(self.max_window, self.m.window()["shards"])
        return c

    def claims_of(self, host: str) -> dict[int, int]:
        return {j.id: j.attempts for j in self.m.jobs("claimed") if j.host == host}

    def frozen_claims(self, host: str, cond) -> dict[int, int]:
        """Wait until cond(sample) and `host` holds a claim; return its claims with its processes stopped
        (SIGSTOP), so that none is published between reading it and what the caller does next."""
        while True:
            self.wait(lambda: cond(self.sample()) and self.claims_of(host), f"{host} to hold a claim")
            assert self.hosts[host].kill_all(signal.SIGSTOP), f"no process on {host}"
            time.sleep(0.2)  # a commit already on the wire lands
            if held := self.claims_of(host):
                return held
            self.hosts[host].kill_all(signal.SIGCONT)

    def wait(self, cond, what: str, timeout: float = 240) -> None:
        t0 = time.time()
        while not cond():
            self.sample()
            assert time.time() - t0 < timeout, f"timed out waiting for {what}\n{self.logs()[-4000:]}"
            assert self.procs["train"].poll() in (None, 0), f"the trainer died\n{self.logs()[-4000:]}"
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> None:
        self.wait(
            lambda: all(p.poll() is not None for p in self.procs.values()), "the run to finish", timeout
        )
        assert self.procs["train"].returncode == 0, self.logs()[-4000:]

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted(self.tmp.glob("*.log")))

    def check(self) -> None:
        logs = self.logs()
        assert not tracebacks(logs), logs[-4000:]
        assert self.max_window <= WINDOW, f"window {self.max_window} > {WINDOW}"
        assert_exactly_once(self.url, self.run_dir)
        self.m.close()
        deadline = time.time() + 3 * LEASE_S  # a killed host's registration lapses with its lease
        while Manifest.open(self.url, readonly=True).live_procs() and time.time() < deadline:
            time.sleep(0.2)
        assert_all_released_and_clean(self.url, self.store, self.run_dir)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def hosts_that_worked(run: Run) -> set[str]:
    with Manifest.open(run.url, readonly=True) as m:
        return {j.host for j in m.jobs()}


def test_two_extract_hosts_and_a_trainer(tmp_path, pg, hosts):
    run = Run(tmp_path, pg, hosts, {"host-a": 0.1, "host-b": 0.1}, n=32)
    try:
        run.start()
        run.finish()
        assert all(p.returncode == 0 for p in run.procs.values()), run.logs()[-3000:]
    finally:
        run.stop()
    run.check()
    assert hosts_that_worked(run) == {"host-a", "host-b"}


def test_extract_host_killed_whole(tmp_path, pg, hosts):
    run = Run(tmp_path, pg, hosts, {"host-a": 0.4, "host-b": 0.1})
    try:
        run.start()
        held = run.frozen_claims("host-a", lambda s: s["written"] + s["consumed"] >= 4)
        hosts["host-a"].kill_all()
        run.finish()
    finally:
        run.stop()
    with Manifest.open(run.url, readonly=True) as m:
        reclaimed = {e["job"] for e in m.events("reclaim") if e["detail"] == "lease expired"}
        assert set(held) <= reclaimed, (held, reclaimed)  # another host's claims go by lease, never by pid
        assert all(m.job(j).attempts > a for j, a in held.items())
    run.check()


@pytest.mark.slow
def test_extract_host_partitioned_then_back(tmp_path, pg, hosts):
    run = Run(tmp_path, pg, hosts, {"host-a": 1.2, "host-b": 0.1})
    a = hosts["host-a"]
    try:
        run.start()
        held = run.frozen_claims("host-a", lambda s: s["written"] >= 3)
        a.partition()
        a.kill_all(signal.SIGCONT)
        try:
            # its leases expire, host-b redoes those jobs; meanwhile host-a finishes them and stages shards
            run.wait(
                lambda: all(
                    run.m.job(j).attempts > n and run.m.job(j).state != "claimed" for j, n in held.items()
                ),
                "host-b to redo host-a's jobs",
            )
            run.wait(
                lambda: any(t.endswith("~host-a") for t in scan_store(run.store)["temps"]),
                "host-a to stage a shard while cut off",
                timeout=30,
            )
        finally:
            a.heal()
        run.finish()
        assert all(p.returncode == 0 for p in run.procs.values()), run.logs()[-3000:]
    finally:
        a.heal()
        run.stop()
    with Manifest.open(run.url, readonly=True) as m:
        refused = {e["job"] for e in m.events("refused")}
        assert set(held) <= refused, (held, m.events("refused"))  # its late publishes were refused
    run.check()  # and its shards removed: nothing left in the store


def test_database_restarted_mid_run(tmp_path, pg, hosts):
    run = Run(tmp_path, pg, hosts, {"host-a": 0.2, "host-b": 0.2})
    try:
        run.start()
        run.wait(
            lambda: run.sample()["released"] + run.sample()["consumed"] >= run.total // 3, "a third trained"
        )
        run.m.close()
        pg.restart()
        run.m = Manifest.open(run.url, readonly=True)
        run.finish()
        assert all(p.returncode == 0 for p in run.procs.values()), run.logs()[-3000:]
    finally:
        run.stop()
    assert "lost the connection to PostgreSQL server" in run.logs()
    run.check()


def test_trainer_ranks_on_two_nodes(tmp_path, pg):
    """`torchrun --nnodes 2` (gloo on localhost), each node its own host name: both ranks admit disjoint
    shards from the shared store; rank 0 writes the manifest, checkpoints and deletes shards."""
    import sys

    from helpers import ROOT
    from multihost import can_rename_host
    from pgcluster import free_port

    why = can_rename_host()
    if why:
        pytest.fail(why) if os.environ.get("DFLASH_REQUIRE_POSTGRES") == "1" else pytest.skip(why)
    url = plan(tmp_path, n=32, epochs=2, extra=EXTRA, manifest=pg.url())
    store, run_dir = tmp_path / "store", tmp_path / "run"
    env = hooked_env(fake_target={"hidden": HIDDEN, "delay_s": 0.05})
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the node names resolve nowhere: rendezvous on the loopback
    port = free_port()
    procs = [
        start(
            ["extract", "--manifest", url, "--store", store, "--devices", "cpu", "--window", WINDOW],
            tmp_path / "extract.log",
            env,
        )
    ]
    for rank in (0, 1):
        cmd = [
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname node-{rank} && exec "$0" "$@"',
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(rank),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "dflash_staged",
            "train",
            "--manifest",
            url,
            "--store",
            str(store),
            "--out",
            str(run_dir),
            "--device",
            "cpu",
        ]
        with open(tmp_path / f"node{rank}.log", "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT))
    m = Manifest.open(url, readonly=True)
    seen = set()
    try:
        t0 = time.time()
        while any(p.poll() is None for p in procs):
            assert time.time() - t0 < 300, "the run did not finish"
            seen |= {(p.host, p.rank) for p in m.live_procs("train")}
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("*.log")))
    assert all(p.returncode == 0 for p in procs) and not tracebacks(logs), logs[-4000:]
    assert seen == {("node-0", 0), ("node-1", 1)}, seen
    state = assert_exactly_once(url, run_dir)
    assert {c.rank for items in state.consumed().values() for c in items} == {0, 1}
    m.close()
    assert_all_released_and_clean(url, store, run_dir)
