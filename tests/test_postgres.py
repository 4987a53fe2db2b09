"""The PostgreSQL manifest against a real server (tests/pgcluster.py): addresses and bad input,
the same jobs and status as SQLite, host identity, a trainer's fence, lost connections."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dflash_staged.manifest import Manifest, ManifestError
from dflash_staged.manifest.postgres.conn import DRIVER

from helpers import ROOT, cli, env, plan, write_config, write_dataset
from pgcluster import free_port

EXTRA = "[data]\ntoken_budget = 512\n[extract]\nlease_s = 2.0\n"


def error_line(code: int, out: str) -> str:
    """The single `error: ...` line of a refused command."""
    assert code == 1 and "Traceback" not in out, out
    lines = [x for x in out.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, out
    return lines[0]


def schemas(pg) -> set[str]:
    return pg.schemas()


def plan_args(tmp_path, manifest, extra=EXTRA, seed=0):
    data = write_dataset(tmp_path / "data.jsonl", n=24)
    cfg = write_config(tmp_path / "cfg.toml", extra)
    return ["plan", "--config", cfg, "--data", data, "--manifest", manifest, "--seed", seed]


# ---------------------------------------------------------------------------------------------- addresses
def test_plan_of_a_postgresql_address_never_makes_a_directory(tmp_path, monkeypatch, pg):
    """Regression: `dflash plan --manifest 'postgresql://host:5432/db#run1'` made a directory `postgresql:`
    in the working directory, wrote a SQLite manifest into it and failed to open it."""
    monkeypatch.chdir(tmp_path)
    args = plan_args(tmp_path, f"postgresql://postgres@127.0.0.1:{free_port()}/postgres#run1")
    line = error_line(*cli(*args))
    assert "cannot reach PostgreSQL server 127.0.0.1:" in line and "check the host and port" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.toml", "data.jsonl"]
    url = pg.url()
    code, out = cli(*plan_args(tmp_path, url))
    assert code == 0 and f"planned {url}" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.toml", "data.jsonl"]
    code, out = cli(*plan_args(tmp_path, url))  # the same plan again: a no-op
    assert code == 0 and "already holds this plan" in out, out


def test_hash_and_question_mark_in_a_manifest_path(tmp_path, monkeypatch):
    """Regression: '#' or '?' in a SQLite manifest path reached SQLite as a URI fragment or query."""
    monkeypatch.chdir(tmp_path)
    code, out = cli(*plan_args(tmp_path, "runs/a#1?b=2"))
    assert code == 0, out
    assert (tmp_path / "runs" / "a#1?b=2" / "manifest.db").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.toml", "data.jsonl", "runs"]
    code, out = cli("status", "--manifest", "runs/a#1?b=2", "--json")
    assert code == 0 and json.loads(out)["total_jobs"] > 0, out


def test_same_jobs_and_status_as_sqlite(tmp_path, pg):
    lite = plan(tmp_path, n=24, epochs=2, extra=EXTRA)
    url = plan(tmp_path, n=24, epochs=2, extra=EXTRA, manifest=pg.url())
    jobs = [json.loads(cli("status", "--manifest", m, "--jobs", "--json")[1]) for m in (lite, url)]
    assert jobs[0] == jobs[1]
    st = [json.loads(cli("status", "--manifest", m, "--json")[1]) for m in (lite, url)]
    assert set(st[0]) == set(st[1])
    for k in (
        "jobs",
        "total_jobs",
        "epochs",
        "window",
        "tokens",
        "tokens_by_state",
        "groups",
        "samples",
        "layer_ids",
        "padding_waste",
        "hosts",
        "processes",
    ):
        assert st[0][k] == st[1][k], k
    with Manifest.open(lite, readonly=True) as a, Manifest.open(url, readonly=True) as b:
        for i in (0, 7, 23):
            assert all((x == y).all() for x, y in zip(a.sample(i), b.sample(i)))
        assert (a.sample_lengths() == b.sample_lengths()).all()


@pytest.mark.parametrize(
    "case",
    [
        "credentials",
        "no_database",
        "no_privilege",
        "not_planned",
        "other_plan",
        "not_a_manifest",
        "no_name",
        "bad_name",
        "unknown_scheme",
    ],
)
def test_bad_input_is_one_line_and_creates_nothing(tmp_path, pg, case):
    before = schemas(pg)
    name = f"bad_{case}_{os.getpid()}"
    if case == "credentials":
        args = plan_args(tmp_path, pg.url(name, user="pwuser", password="wrong"))
        want = ["refused user 'pwuser'", "password authentication failed", "fix the user or password"]
    elif case == "no_database":
        args = plan_args(tmp_path, pg.url(name, db="nosuchdb"))
        want = ["database 'nosuchdb' does not exist", "createdb"]
    elif case == "no_privilege":
        args = plan_args(tmp_path, pg.url(name, user="noperm"))
        want = ["user 'noperm' may not create the manifest schema", "GRANT CREATE ON DATABASE postgres"]
    elif case == "not_planned":
        args = ["status", "--manifest", pg.url(name)]
        want = [
            f"no manifest '{name}' in database 'postgres'",
            "run `dflash plan --config CONFIG.toml --data",
        ]
    elif case == "other_plan":
        url = plan(tmp_path, extra=EXTRA, manifest=pg.url(name))
        before = schemas(pg)
        args = plan_args(tmp_path, url, seed=7)
        want = ["planned from different inputs", "seed: 0 -> 7"]
    elif case == "not_a_manifest":
        pg.sql(f'CREATE SCHEMA "{name}"')
        before = schemas(pg)
        args = ["status", "--manifest", pg.url(name)]
        want = [f"schema '{name}'", "holds no dflash manifest"]
    elif case == "no_name":
        args = plan_args(tmp_path, pg.url(name).split("#")[0])
        want = ["needs a database and a manifest name", "#NAME"]
    elif case == "bad_name":
        args = plan_args(tmp_path, pg.url("pg_x"))
        want = ["manifest name 'pg_x'", "not starting with pg_"]
    else:
        args = plan_args(tmp_path, "mysql://h/db#x")
        want = ["unknown kind of URL"]
    line = error_line(*cli(*args))
    for w in want:
        assert w in line, line
    assert "wrong" not in line  # never the password
    assert schemas(pg) == before
    assert not (tmp_path / "postgresql:").exists() and not (tmp_path / "mysql:").exists()


def test_missing_driver_names_the_extra(tmp_path, pg):
    code = (
        f"import sys; sys.modules[{DRIVER!r}] = None; from dflash_staged.cli import main; "
        "main(['status', '--manifest', sys.argv[1]])"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, pg.url()], cwd=ROOT, env=env(), capture_output=True, text=True
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "pip install 'dflash-staged[postgres]'" in r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------- liveness
HOLD = """
import sys, time
import dflash_staged.procs as procs
if len(sys.argv) > 2:
    procs.BOOT_ID = sys.argv[2]  # pretend this claim was made in another boot of this host
from dflash_staged.manifest import Manifest
m = Manifest.open(sys.argv[1])
print(m.claim("holder", window=99, lease_s=3600).job.id, flush=True)
time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
"""


def test_claims_of_another_boot_or_host(tmp_path, pg):
    url = plan(tmp_path, extra=EXTRA, manifest=pg.url())
    m = Manifest.open(url)
    # another boot of this host: provably gone even though the pid is alive right now
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, url, "0000-old-boot", "60"],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        held = int(p.stdout.readline())
        assert m.claim("me", window=99).job.id == held
    finally:
        p.kill()
        p.wait()
    # another host (its own UTS namespace): not provably gone, so it waits for its lease
    r = subprocess.run(
        [
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname other-host && exec "$0" "$@"',
            sys.executable,
            "-c",
            HOLD,
            url,
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
    )
    if r.returncode != 0 and "unshare" in r.stderr:
        pytest.skip(f"unshare --uts: {r.stderr.strip()}")
    other = int(r.stdout)
    assert m.job(other).host == "other-host" and m.job(other).state == "claimed"
    got = m.claim("me", window=99).job.id
    assert got != other and m.job(other).state == "claimed"
    st = m.status()
    hosts = {h["host"]: h for h in st["hosts"]}
    assert [w["jobs"] for w in hosts["other-host"]["workers"]] == [[other]]
    assert hosts["other-host"]["workers"][0]["lease_left_s"] > 3000
    code, out = cli("status", "--manifest", url)
    assert code == 0 and "host other-host: no live process | holder pid" in out and "lease 3" in out, out
    m.close()


def test_replaced_trainer_stops(tmp_path, pg):
    url = plan(tmp_path, extra=EXTRA, manifest=pg.url())
    a, b = Manifest.open(url), Manifest.open(url)
    me = a.register("train", group_id="A", rank=0, exclusive=True)
    assert a.take("A", 0, 2) == []
    b.unregister(me)  # what another trainer's register does to a registration whose heartbeat lapsed
    with pytest.raises(ManifestError, match="registration .* lapsed"):
        a.take("A", 0, 2)
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------- connections
def test_lost_connection_is_retried_then_stops_naming_the_server(tmp_path, pg, monkeypatch):
    url = plan(tmp_path, extra=EXTRA, manifest=pg.url())
    m = Manifest.open(url)
    job = m.claim("w", window=9).job
    calls = []

    def commit():  # the server goes away inside the publish transaction, after the rename
        calls.append(1)
        pg.terminate_clients()

    assert m.publish(job, 10, "c", commit=commit)  # reconnected, finished without renaming twice
    assert calls == [1] and m.job(job.id).state == "written"
    pg.restart()  # a server restart between operations: the next one reconnects
    assert m.claim("w", window=9).job is not None
    monkeypatch.setenv("DFLASH_PG_RETRY_S", "1.5")
    pg.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(
            ManifestError,
            match=rf"lost the connection to PostgreSQL server 127.0.0.1:{pg.port} .* "
            r"could not reconnect for 2 s",
        ):
            m.counts()
        assert time.monotonic() - t0 < 20
        with pytest.raises(ManifestError, match="lost the connection"):  # the handle refuses at once now
            m.window()
    finally:
        pg.start()
    m.close()


def test_launchers_take_a_manifest_address(tmp_path, pg):
    from test_launch import dry, flag, proc_line

    url = pg.url()
    lines = dry(
        "pipeline",
        "--config",
        "configs/tiny.toml",
        "--data",
        "d.jsonl",
        "--workdir",
        str(tmp_path / "w"),
        "--manifest",
        url,
    )
    for name in ("plan", "extract", "train"):
        assert flag(proc_line(lines, name)[1], "--manifest") == url
    assert flag(proc_line(lines, "extract")[1], "--store") == str(tmp_path / "w" / "store")
    assert not (tmp_path / "w").exists()
