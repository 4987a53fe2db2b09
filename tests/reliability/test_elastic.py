"""Nodes come and go (issue 41): an elastic trainer job re-forms by itself. Three simulated nodes (distinct
node names, stores and run directories on this machine, one PostgreSQL manifest, gloo on the loopback)
run extract and an elastic trainer (``--nnodes 2:3 --max-restarts``); one node's processes are killed
with SIGKILL mid-run, the two others re-form and go on with no command from the test; a fresh node then
starts, joins, receives the newest checkpoint over the process group and trains. Every job is trained
exactly once, every store ends empty, and the final checkpoint is the same on every node."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from test_node_local_run import EXTRA, extract_args, node_env, spawn, trained_once

from dflash_staged.errors import DflashError
from dflash_staged.launch.elastic import check_elastic, parse_nnodes
from dflash_staged.manifest import Manifest
from dflash_staged.train.checkpoint import latest_checkpoint, load_checkpoint

from helpers import plan
from rel_helpers import scan_store, tracebacks


def test_elastic_settings_that_cannot_re_form_are_refused():
    assert parse_nnodes("3") == (3, 3) and parse_nnodes("2:3") == (2, 3)
    for bad in ("3:2", "0:2", "a", "2:"):
        with pytest.raises(DflashError, match="MIN:MAX"):
            parse_nnodes(bad)
    url = "postgresql://u@h:5432/d#m"
    with pytest.raises(DflashError, match="--max-restarts 0.*give --max-restarts"):
        check_elastic((2, 3), 0, "h:1", url)
    with pytest.raises(DflashError, match="rendezvous host"):
        check_elastic((2, 3), 3, None, url)
    with pytest.raises(DflashError, match="postgresql://"):
        check_elastic((2, 3), 3, "h:1", "/tmp/manifest")
    check_elastic((2, 3), 3, "h:1", url)
    check_elastic((1, 1), 0, None, "/tmp/manifest")  # not elastic: nothing to check


def trainer(node, port, url, store, run, log, env):
    cmd = [
        "-m", "dflash_staged", "train", "--manifest", url, "--store", str(store), "--out", str(run),
        "--device", "cpu", "--node-local", "--nnodes", "2:3", "--max-restarts", "6",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
    ]  # fmt: skip
    return spawn(cmd, log, env)


@pytest.mark.slow
def test_nodes_leave_and_come_and_the_job_re_forms_by_itself(tmp_path, pg):
    from pgcluster import free_port

    url = plan(tmp_path, n=160, epochs=2, extra=EXTRA + "[train]\ncheckpoint_every = 2\n", manifest=pg.url())
    nodes = ("node-a", "node-b", "node-c", "node-d")
    stores = {n: tmp_path / f"store-{n}" for n in nodes}
    runs = {n: tmp_path / f"run-{n}" for n in nodes}
    port = free_port()
    conf = {"DFLASH_RDZV_CONF": "last_call_timeout=3,join_timeout=240", "LOGLEVEL": "INFO"}
    envs = {n: {**node_env(n, delay_s=0.15), **conf} for n in nodes}
    procs: dict[str, object] = {}

    def start_node(node):
        cmd = ["-m", "dflash_staged", *extract_args(url, stores[node])]
        procs[f"extract-{node}"] = spawn(cmd, tmp_path / f"extract-{node}.log", envs[node])
        log = tmp_path / f"train-{node}.log"
        procs[f"train-{node}"] = trainer(node, port, url, stores[node], runs[node], log, envs[node])

    m = Manifest.open(url, readonly=True)

    def logs() -> str:
        return "".join(p.read_text() for p in sorted(tmp_path.glob("*.log")))

    def wait(cond, what, timeout=300):
        t0 = time.time()
        while not cond():
            assert time.time() - t0 < timeout, f"timed out waiting for {what}\n{logs()[-6000:]}"
            time.sleep(0.1)

    try:
        start_node("node-a")  # the rendezvous lives in node-a's agent: it stays
        time.sleep(2.0)
        start_node("node-b")
        start_node("node-c")
        wait(
            lambda: m.counts()["released"] >= 4 and any(j.host == "node-b" for j in m.jobs("written")),
            "a release, and node-b holding written shards",
        )
        for name in ("extract-node-b", "train-node-b"):
            os.killpg(procs[name].pid, signal.SIGKILL)
        lost = {j.id for j in m.jobs("written") if j.host == "node-b"}
        wait(lambda: any(e["left"] == ["node-b"] for e in m.reformations()), "a re-formation without node-b")
        done_before = m.counts()["released"]
        start_node("node-d")  # a fresh node: no checkpoint, an empty store
        wait(lambda: any(e["came"] == ["node-d"] for e in m.reformations()), "node-d to join")
        live = [p for k, p in procs.items() if "node-b" not in k]
        wait(lambda: all(p.poll() is not None for p in live), "the run to finish", 600)
        assert all(p.returncode == 0 for p in live), logs()[-6000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    text = logs()
    bad = [t for t in tracebacks(text) if "node-b" not in t and "PeerLost" not in t]
    assert not bad, bad[:2]
    assert "lack checkpoint" in text and "sends it" in text, text[-3000:]  # node-d caught up
    state = trained_once(url, runs["node-a"])
    final = latest_checkpoint(runs["node-a"])
    for node in ("node-c", "node-d"):  # the same final checkpoint on every node that stayed or came
        copy = latest_checkpoint(runs[node])
        assert copy is not None and copy.name == final.name, node
        assert (copy / "model.safetensors").read_bytes() == (final / "model.safetensors").read_bytes(), node
        assert load_checkpoint(copy).consumed() == state.consumed(), node
    requeued = {e["job"] for e in m.events("requeue") if "lost node" in (e["detail"] or "")}
    assert lost <= requeued, (lost, requeued)
    trained = [c.job for items in state.consumed().values() for c in items]
    trained_on_d = {j for j in trained if m.job(j).host == "node-d"}
    reforms = m.reformations()
    print(
        f"\nlost node-b with {len(lost)} written job(s) (re-extracted elsewhere); {done_before} released "
        f"before node-d came, which trained {len(trained_on_d)} job(s); re-formations: "
        + json.dumps([{k: e[k] for k in ("step", "ranks", "left", "came")} for e in reforms])
    )
    assert trained_on_d, "node-d joined but trained nothing"
    st_all = m.status()
    assert st_all["jobs"]["released"] == st_all["total_jobs"], st_all["jobs"]
    m.close()
    for node in ("node-a", "node-c", "node-d"):
        scan = scan_store(stores[node])
        assert scan["published"] == [] and scan["temps"] == [], (node, scan)
