"""Node-local stores at the manifest (dflash_staged.manifest.layout): windows, admission, lost nodes and
stale shards are per node, on each backend. The run itself: tests/reliability/test_node_local_run.py."""

import pytest
from test_manifest import at, make  # noqa: F401 - the fixture, and the manifest maker

from dflash_staged.manifest import ManifestError
from dflash_staged.manifest.layout import settle_layout
from dflash_staged.manifest.postgres import claims as pg_claims
from dflash_staged.manifest.sqlite import transitions as sq_transitions


@pytest.fixture
def as_node(monkeypatch):
    """as_node(name): this process claims as node ``name`` from now on."""

    def switch(name: str) -> None:
        for mod in (pg_claims, sq_transitions):
            monkeypatch.setattr(mod, "my_identity", lambda: (name, 4242, 1))

    return switch


def claim(m, node: str, window: int):
    return m.claim("w0", window=window, node=node)


def test_each_node_has_its_own_window_and_takes_its_own_shards(at, as_node):  # noqa: F811
    m = make(at, n_batches=8)
    held = {}
    for node in ("node-a", "node-b"):
        as_node(node)
        got = [claim(m, node, window=3) for _ in range(4)]
        assert [r.job is not None for r in got] == [True, True, True, False], node
        assert got[-1].window_full and got[-1].window["shards"] == 3  # this node's three, not six
        held[node] = [r.job for r in got[:3]]
        for j in held[node]:
            assert m.publish(j, 100, "c")
    assert m.window("node-a") == {"shards": 3, "bytes": 300} and m.window()["shards"] == 6
    assert m.ready_count("node-b") == 3 and m.ready_count() == 6
    a = m.take("t", 0, 8, node="node-a")
    assert sorted(j.id for j in a) == sorted(j.id for j in held["node-a"])
    assert m.take("t", 0, 8, node="node-a") == []  # node-b's shards stay for node-b's ranks
    assert m.ready_count("node-b") == 3


def test_a_lost_node_returns_its_written_jobs_and_its_stale_shards_are_unwanted(at, as_node):  # noqa: F811
    m = make(at, n_batches=6)
    jobs = {}
    for node in ("node-a", "node-b"):
        as_node(node)
        jobs[node] = [claim(m, node, window=10).job for _ in range(3)]
        for j in jobs[node]:
            assert m.publish(j, 100, "c")
    b0, b1, b2 = jobs["node-b"]
    m.consume([b0.id], 1, {b0.id: 1})  # trained, and covered by the checkpoint the trainer resumes from
    m.resume_trainer({b0.id: 1})
    assert m.requeue_absent_nodes(["node-a"]) == (2, 1)  # node-b is gone: b1, b2 re-extracted, b0 released
    assert [m.job(j.id).state for j in jobs["node-b"]] == ["released", "pending", "pending"]
    assert {m.job(j.id).state for j in jobs["node-a"]} == {"written"}
    assert {e["job"] for e in m.events("requeue")} == {b1.id, b2.id}
    # node-b back with its old shards: every one of them is unwanted there, none on node-a
    assert all(m.shard_unwanted(j.id, node="node-b") for j in jobs["node-b"])
    as_node("node-a")
    again = claim(m, "node-a", window=10).job
    assert again.id == b1.id
    assert m.shard_unwanted(b1.id, node="node-b") and not m.shard_unwanted(b1.id, node="node-a")
    assert not any(m.shard_unwanted(j.id, node="node-a") for j in jobs["node-a"])
    assert all(m.shard_unwanted(j.id, node="node-b") for j in jobs["node-a"])  # another node's shard


def test_the_layout_is_recorded_once_and_the_other_one_refused(at):  # noqa: F811
    m = make(at, n_batches=2)
    assert settle_layout(m, True, "dflash extract") == "node"
    assert settle_layout(m, True, "dflash train") == "node"
    with pytest.raises(ManifestError, match="node-local stores.*dflash train must run with --node-local"):
        settle_layout(m, False, "dflash train")
    other = make(at, name="other", n_batches=2)
    assert settle_layout(other, False, "dflash extract") == "shared"
    with pytest.raises(ManifestError, match="one shared store.*without --node-local"):
        settle_layout(other, True, "dflash train")


def test_a_starved_node_beside_a_full_window_is_named():
    from dflash_staged.manifest.balance import node_imbalance

    def side(**kinds):
        return {"recent": kinds, "total": kinds}

    nodes = {
        "node-a": {
            "extract": side(busy_s=2.0, window_full_s=8.0, no_work_s=0.0),
            "train": side(busy_s=9.0, data_wait_s=1.0),
        },
        "node-b": {
            "extract": side(busy_s=10.0, window_full_s=0.0, no_work_s=0.0),
            "train": side(busy_s=3.0, data_wait_s=7.0),
        },
    }
    text = node_imbalance(nodes)
    assert text.startswith("node(s) node-b: trainer ranks wait") and "window of node-a is full" in text
    assert "give node-b more extract GPUs" in text
    nodes["node-b"]["train"] = side(busy_s=9.0, data_wait_s=1.0)
    assert node_imbalance(nodes) is None  # nobody starves: the full window is only a fast extract


def test_dflash_node_starts_its_share_of_one_torchrun_job(tmp_path, pg):
    """`dflash node --nnodes 2 --node-rank 1 --node-local`: this node's extract (its window rule counting
    its own ranks) and its share of the torchrun job, both with --node-local; node 1 does not plan."""
    from test_launch import dry, flag, proc_line

    from helpers import plan

    url = plan(tmp_path, n=8, manifest=pg.url())
    args = ["node", "--config", str(tmp_path / "cfg.toml"), "--data", str(tmp_path / "data.jsonl")]
    args += [
        "--workdir",
        str(tmp_path / "w"),
        "--manifest",
        url,
        "--extract-gpus",
        "0",
        "--train-gpus",
        "1,2",
    ]
    lines = dry(*args, "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--node-local")
    assert any(x.startswith("[dry-run] plan: skipped") for x in lines)
    _, ex = proc_line(lines, "extract")
    _, tr = proc_line(lines, "train")
    assert "--node-local" in ex and flag(ex, "--train-ranks") == "2"
    assert tr[1:3] == ["-m", "torch.distributed.run"] and "--node-local" in tr
    assert (flag(tr, "--nnodes"), flag(tr, "--node-rank"), flag(tr, "--nproc-per-node")) == ("2", "1", "2")
    assert flag(tr, "--master-addr") == "10.0.0.1" and flag(tr, "--store") == str(tmp_path / "w" / "store")
    shared = dry(*args, "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1")
    assert flag(proc_line(shared, "extract")[1], "--train-ranks") == "4"  # one store feeds every node's ranks
    # elastic: torchrun's elastic agent, a c10d rendezvous at --master-addr, the window rule at MAX nodes
    elastic = dry(
        *args, "--nnodes", "2:3", "--max-restarts", "5", "--master-addr", "10.0.0.1", "--node-rank", "1"
    )
    env, tr = proc_line(elastic, "train")
    assert (flag(tr, "--nnodes"), flag(tr, "--max-restarts"), flag(tr, "--rdzv-backend")) == (
        "2:3",
        "5",
        "c10d",
    )
    assert flag(tr, "--rdzv-endpoint") == "10.0.0.1:29500" and flag(tr, "--rdzv-id").startswith("dflash-")
    assert "--node-rank" not in tr and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert flag(proc_line(elastic, "extract")[1], "--train-ranks") == "6"


def test_dflash_node_refuses_a_multinode_run_it_cannot_start(tmp_path):
    from click.testing import CliRunner

    from dflash_staged.cli import main

    args = ["node", "--config", "configs/tiny.toml", "--data", "d.jsonl", "--workdir", str(tmp_path)]
    args += ["--extract-gpus", "0", "--train-gpus", "1", "--dry-run", "--nnodes", "2"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code != 0 and "give --master-addr" in r.output
    r = CliRunner().invoke(main, [*args, "--master-addr", "n0"])
    assert r.exit_code != 0 and "--manifest postgresql://" in r.output
    r = CliRunner().invoke(main, [*args[:-2], "--nnodes", "2:3", "--master-addr", "n0"])
    assert r.exit_code != 0 and "--max-restarts 0" in r.output and len(r.output.strip().splitlines()) == 1


def test_a_node_replays_its_own_kept_shards(at, as_node):  # noqa: F811
    from dflash_staged.train.sources import ReplaySource

    m = make(at, n_batches=6)
    held = {}
    for node in ("node-a", "node-b"):
        as_node(node)
        held[node] = [claim(m, node, window=10).job for _ in range(3)]
        for j in held[node]:
            assert m.publish(j, 100, "c")
    every = [j.id for js in held.values() for j in js]
    m.consume(every, 1, dict.fromkeys(every, 0))
    m.release(every, keep=True)
    mine = ReplaySource(m, store=None, node="node-b")
    assert sorted(j.id for j in mine.sequence) == sorted(j.id for j in held["node-b"])
    assert len(ReplaySource(m, store=None).sequence) == 6  # a store gathered from every node: all of them
    with pytest.raises(Exception, match="no kept shards to replay on node node-c"):
        ReplaySource(m, store=None, node="node-c")


def test_a_node_window_too_small_for_its_ranks_is_refused_up_front(tmp_path):
    """Per node, the window must hold train.buffer_capacity (4 in the tiny config) x the node's ranks:
    extract refuses --window 3 for one rank before any claim, and so does a trainer told so."""
    from click.testing import CliRunner

    from dflash_staged.cli import main
    from dflash_staged.manifest import Manifest

    from helpers import plan

    url = plan(tmp_path, n=8)
    store = tmp_path / "store"
    r = CliRunner().invoke(
        main, ["extract", "--manifest", str(url), "--store", str(store), "--window", "3", "--node-local"]
    )
    assert r.exit_code != 0 and "--window 3 < train.buffer_capacity 4 x 1" in r.output, r.output
    with Manifest.open(url) as m:
        c = m.counts()
        assert c["pending"] == sum(c.values()) and m.meta["store_layout"] == "node"
        m.set_meta("extract_window", {"shards": 3, "bytes": 0, "workers": 1, "shard_bytes_max": 0})
    args = [
        "train",
        "--manifest",
        str(url),
        "--store",
        str(store),
        "--out",
        str(tmp_path / "run"),
        "--node-local",
    ]
    r = CliRunner().invoke(main, [*args, "--device", "cpu"])
    assert r.exit_code != 0 and "--window 3 < train.buffer_capacity 4 x 1" in r.output, r.output
    assert not store.exists()  # refused before anything was written
