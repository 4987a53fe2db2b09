"""Two nodes, no shared store: each node's extract writes into its own store, and its trainer rank (one
torchrun job spanning both nodes, gloo on the loopback) trains only on that store's shards
(dflash_staged.manifest.layout). The nodes are simulated on this machine with DFLASH_NODE_NAME, each
process given only its own node's store path; one PostgreSQL manifest."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dflash_staged.manifest import Manifest
from dflash_staged.manifest.status import format_nodes
from dflash_staged.train.checkpoint import latest_checkpoint, load_checkpoint

from helpers import ROOT, plan, start
from rel_helpers import (
    assert_all_released_and_clean,
    assert_exactly_once,
    hooked_env,
    scan_store,
    tracebacks,
)

# per node: the tiny config's buffer_capacity 4 x 1 rank fits; one window for both nodes' 2 ranks would
# need 8 and be refused, so these runs also show that the window rule counts a node's own ranks
WINDOW = 6
EXTRA = "[data]\ntoken_budget = 512\n[extract]\nlease_s = 2.0\n"
HIDDEN = 128  # the tiny target's
NODES = ("node-a", "node-b")


def node_env(node: str, **fake) -> dict:
    env = hooked_env(fake_target={"hidden": HIDDEN, **fake})
    env["DFLASH_NODE_NAME"] = node
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def extract_args(url, store) -> list:
    return [
        "extract",
        "--manifest",
        url,
        "--store",
        store,
        "--devices",
        "cpu",
        "--window",
        WINDOW,
        "--node-local",
    ]


def spawn(args: list, log, env) -> subprocess.Popen:
    """``python ARGS`` in a session of its own (a node's processes die together: os.killpg)."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, args))}\n")
        f.flush()
        return subprocess.Popen(
            [sys.executable, *map(str, args)], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def torchrun(rank: int, port: int, url, store, run_dir, log, env, nnodes: int = 2) -> subprocess.Popen:
    cmd = [
        "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", "1",
        "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
        "-m", "dflash_staged", "train", "--manifest", url, "--store", str(store), "--out", str(run_dir),
        "--device", "cpu", "--node-local",
    ]  # fmt: skip
    return spawn(cmd, log, env)


def test_two_nodes_each_train_on_their_own_store(tmp_path, pg):
    from pgcluster import free_port

    url = plan(tmp_path, n=32, epochs=2, extra=EXTRA, manifest=pg.url())
    stores = {n: tmp_path / f"store-{n}" for n in NODES}
    runs = {n: tmp_path / f"run-{n}" for n in NODES}  # no shared directory at all: --out on each node too
    run_dir, port = runs["node-a"], free_port()
    procs = []
    for i, node in enumerate(NODES):
        env = node_env(node, delay_s=0.05 if i == 0 else 0.15)  # uneven nodes: node-a extracts 3x faster
        procs.append(start(extract_args(url, stores[node]), tmp_path / f"extract-{node}.log", env))
        procs.append(torchrun(i, port, url, stores[node], runs[node], tmp_path / f"train-{node}.log", env))
    m = Manifest.open(url, readonly=True)
    peak = dict.fromkeys(NODES, 0)
    try:
        t0 = time.time()
        while any(p.poll() is None for p in procs):
            assert time.time() - t0 < 300, "the run did not finish"
            for node in NODES:
                peak[node] = max(peak[node], m.window(node)["shards"])
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("*.log")))
    assert all(p.returncode == 0 for p in procs) and not tracebacks(logs), logs[-4000:]
    state = assert_exactly_once(url, run_dir)
    copy = latest_checkpoint(runs["node-b"])  # node-b's first rank keeps its own copy of every checkpoint
    assert copy is not None and copy.name == latest_checkpoint(run_dir).name
    assert load_checkpoint(copy).consumed() == state.consumed()
    writer = {j.id: j.host for j in m.jobs()}
    assert set(writer.values()) == set(NODES)
    trained_on = {c.job: NODES[c.rank] for items in state.consumed().values() for c in items}
    wrong = {j: (writer[j], n) for j, n in trained_on.items() if writer[j] != n}
    assert not wrong, f"jobs trained by a rank of another node than the one holding the shard: {wrong}"
    assert m.events("requeue") == []  # no rank looked for a shard in its store that was not there
    assert all(0 < peak[n] <= WINDOW for n in NODES), peak
    per_node = {n: sum(1 for h in writer.values() if h == n) for n in NODES}
    print(f"\njobs {len(writer)}, written per node {per_node}, peak shards per node {peak}")
    m.close()
    for node in NODES:
        assert scan_store(stores[node])["published"] == [], node
    st = assert_all_released_and_clean(url, stores["node-a"], run_dir)
    nodes = st["nodes"]["nodes"]  # dflash status: per node, both sides' final figures
    assert set(nodes) == set(NODES), nodes
    for node in NODES:
        assert nodes[node]["balance"]["extract"] and nodes[node]["balance"]["train"], (node, nodes[node])
        assert nodes[node]["window"] == {"shards": 0, "bytes": 0}
    print("\n".join(format_nodes(st["nodes"])))


@pytest.mark.slow
def test_a_node_back_with_stale_shards_removes_them(tmp_path, pg):
    """node-a extracts everything (no trainer); node-b comes up holding a copy of node-a's shards (jobs
    it does not hold) and a shard of a released job: its extract removes them all, node-a's stay."""
    url = plan(tmp_path, n=8, epochs=1, extra=EXTRA, manifest=pg.url())
    a, b = tmp_path / "store-a", tmp_path / "store-b"
    env_a = node_env("node-a", delay_s=0.0)
    cmd = [sys.executable, "-m", "dflash_staged", *map(str, extract_args(url, a)), "--window", "100"]
    r = subprocess.run(cmd, cwd=ROOT, env=env_a, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    published = scan_store(a)["published"]
    assert published
    shutil.copytree(a, b)
    cmd_b = [sys.executable, "-m", "dflash_staged", *map(str, extract_args(url, b))]
    r = subprocess.run(cmd_b, cwd=ROOT, env=node_env("node-b"), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert scan_store(b)["published"] == [], r.stderr[-2000:]
    assert scan_store(a)["published"] == published


def trained_once(url, run_dir) -> dict:
    """Every job of every epoch in exactly one step of the newest checkpoint's record (a trainer rerun on
    another node keeps no metrics.jsonl of the steps before: the record is the proof)."""
    with Manifest.open(url, readonly=True) as m:
        every = sorted(j.id for j in m.jobs())
    state = load_checkpoint(latest_checkpoint(run_dir))
    ids = [c.job for items in state.consumed().values() for c in items]
    assert sorted(ids) == every, (sorted(set(every) - set(ids)), len(ids), len(set(ids)))
    return state


def test_a_node_lost_whole_and_the_job_rerun_without_it(tmp_path, pg):
    """node-a, rank 0's node (its extract, its torchrun and rank, and the rendezvous), is killed with
    SIGKILL once a checkpoint released shards and it holds written ones. node-b's rank loses its peer at
    the next collective and exits; node-b's trainer is rerun alone (--nnodes 1, the documented rerun)
    from its own copy of the checkpoints: node-a's written jobs go back to extract, node-b re-extracts
    them, every job is trained exactly once. node-a then comes back and cleans its disk."""
    from pgcluster import free_port

    url = plan(tmp_path, n=48, epochs=2, extra=EXTRA, manifest=pg.url())
    stores = {n: tmp_path / f"store-{n}" for n in NODES}
    runs = {n: tmp_path / f"run-{n}" for n in NODES}
    port = free_port()
    envs = {n: node_env(n, delay_s=0.15) for n in NODES}
    procs = {}
    for i, node in enumerate(NODES):
        procs[f"extract-{node}"] = spawn(
            ["-m", "dflash_staged", *extract_args(url, stores[node])],
            tmp_path / f"extract-{node}.log",
            envs[node],
        )
        log = tmp_path / f"train-{node}.log"
        procs[f"train-{node}"] = torchrun(i, port, url, stores[node], runs[node], log, envs[node])
    m = Manifest.open(url, readonly=True)

    def logs() -> str:
        return "".join(p.read_text() for p in sorted(tmp_path.glob("*.log")))

    def wait(cond, what, timeout=240):
        t0 = time.time()
        while not cond():
            assert time.time() - t0 < timeout, f"timed out waiting for {what}\n{logs()[-4000:]}"
            time.sleep(0.05)

    try:
        wait(
            lambda: m.counts()["released"] >= 4 and any(j.host == "node-a" for j in m.jobs("written")),
            "a release, and node-a holding written shards",
        )
        for name in ("extract-node-a", "train-node-a"):
            os.killpg(procs[name].pid, signal.SIGKILL)
        lost = {j.id for j in m.jobs("written") if j.host == "node-a"}
        wait(lambda: procs["train-node-b"].poll() is not None, "node-b's trainer to lose its peer", 180)
        assert procs["train-node-b"].returncode != 0
        wait(lambda: not [p for p in m.live_procs() if p.host == "node-a"], "node-a's registrations to lapse")
        if procs["extract-node-b"].poll() is not None:  # it may have left with the trainer gone: rerun it too
            procs["extract-node-b"] = spawn(
                ["-m", "dflash_staged", *extract_args(url, stores["node-b"])],
                tmp_path / "extract-node-b.log",
                envs["node-b"],
            )
        log = tmp_path / "train-node-b.log"
        procs["train-node-b"] = torchrun(
            0, free_port(), url, stores["node-b"], runs["node-b"], log, envs["node-b"], nnodes=1
        )
        live = [procs["extract-node-b"], procs["train-node-b"]]
        wait(lambda: all(p.poll() is not None for p in live), "the rerun to finish", 300)
        assert all(p.returncode == 0 for p in live), logs()[-4000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    text = logs()
    assert "go back to extract" in text, text[-3000:]
    assert "another trainer rank is gone" in text, text[-3000:]  # one line, the lost peer named
    steps = [tuple(map(int, x)) for x in re.findall(r"step (\d+)/(\d+)", text)]
    assert steps and all(n <= total for n, total in steps), steps  # the schedule refitted to one node
    trained_once(url, runs["node-b"])
    requeued = {e["job"] for e in m.events("requeue") if "lost node" in (e["detail"] or "")}
    assert lost <= requeued, (lost, requeued)
    assert all(m.job(j).host == "node-b" for j in requeued)  # re-extracted by the node that remained
    stale = scan_store(stores["node-a"])["published"]
    print(
        f"\nlost node-a (rank 0's) with {len(lost)} written job(s); {len(requeued)} re-extracted; "
        f"{len(stale)} stale shards"
    )
    assert stale, "node-a's disk should still hold the shards it lost"
    r = subprocess.run(
        [sys.executable, "-m", "dflash_staged", *map(str, extract_args(url, stores["node-a"]))],
        cwd=ROOT, env=envs["node-a"], capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    m.close()
    for node in NODES:
        assert scan_store(stores[node])["published"] == [], node
    assert_all_released_and_clean(url, stores["node-b"], runs["node-b"])
