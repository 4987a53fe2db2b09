"""A stop signal that reaches only some trainer ranks stops all of them at once (issue 33, item 1).

Before the fix, the loop branched on the rank's own ``stop`` flag after ``gather_step`` had agreed on
it: the signalled rank went on to the final checkpoint (a collective) while the other paired that
collective with its next wait, and both sat in mismatched collectives until the 2-hour timeout.
Here two ranks train, extract is frozen (SIGSTOP: alive and registered, so the ranks wait for
shards holding consumed shards no checkpoint covers), and SIGTERM goes to one rank's pid only (or
to both): both ranks must checkpoint and exit within seconds, and a rerun must finish every job
exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from dflash_staged.manifest import Manifest
from dflash_staged.train.checkpoint import latest_checkpoint, load_checkpoint

from helpers import plan, run, start
from rel_helpers import assert_all_released_and_clean, assert_exactly_once, hooked_env, tracebacks

EXTRA = "[data]\ntoken_budget = 512\n"
STOP_WITHIN_S = 30.0  # "within seconds": the ranks start two Python processes' worth of shutdown


def _freeze(p, sig) -> None:
    """SIGSTOP / SIGCONT an extract supervisor and its workers."""
    procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    for q in procs:
        q.send_signal(sig)


def _settled(m, quiet_s: float = 1.5):
    """A condition: no job consumed for ``quiet_s`` (the ranks drew what they could and now wait)."""
    seen = {"n": -1, "since": time.time()}

    def cond() -> bool:
        n = m.counts()["consumed"]
        if n != seen["n"]:
            seen.update(n=n, since=time.time())
        return time.time() - seen["since"] >= quiet_s

    return cond


def _ranks(launcher) -> dict[int, int]:
    """rank -> pid of `dflash train --nproc`'s ranks (torchrun's children, by their RANK)."""
    out = {}
    for c in psutil.Process(launcher.pid).children(recursive=True):
        try:
            rank = c.environ().get("RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None and "dflash_staged" in " ".join(c.cmdline()):
            out[int(rank)] = c.pid
    return out


def _wait(cond, timeout: float, what: str, logs) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs()[-4000:]}")
        time.sleep(0.05)


@pytest.mark.parametrize("who", ["one", pytest.param("both", marks=pytest.mark.slow)])
def test_a_stop_seen_by_one_rank_stops_both_at_once(tmp_path, who):
    mdir = plan(tmp_path, n=160, extra=EXTRA)
    store, out = tmp_path / "store", tmp_path / "run"
    total = sum(Manifest.open(mdir, readonly=True).counts().values())

    def logs() -> str:
        return "".join(
            (tmp_path / f).read_text() for f in ("extract.log", "train.log") if (tmp_path / f).exists()
        )

    ex = start(
        [
            "extract",
            "--manifest",
            mdir,
            "--store",
            store,
            "--devices",
            "cpu",
            "--window",
            8,
            "--train-ranks",
            2,
        ],
        tmp_path / "extract.log",
    )
    train_args = [
        "train",
        "--manifest",
        mdir,
        "--store",
        store,
        "--out",
        out,
        "--nproc",
        2,
        "--device",
        "cpu",
    ]
    train_args += ["--set", "train.checkpoint_every=1000"]  # only the stop (or the end) checkpoints
    tr = start(train_args, tmp_path / "train.log")
    try:
        with Manifest.open(mdir, readonly=True) as m:
            # a few jobs extracted and trained on, then extract frozen: the ranks wait for shards
            _wait(lambda: m.counts()["consumed"] >= 2 or tr.poll() is not None, 240, "two steps", logs)
            assert tr.poll() is None, logs()[-4000:]
            _freeze(ex, signal.SIGSTOP)
            _wait(_settled(m), 120, "the ranks to wait for shards", logs)
            ranks = _ranks(tr)
            assert sorted(ranks) == [0, 1], ranks
            consumed = m.counts()["consumed"]
            assert consumed < total
        victims = [ranks[1]] if who == "one" else list(ranks.values())
        t0 = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGTERM)
        try:
            tr.wait(timeout=STOP_WITHIN_S)
        except Exception:
            tr.kill()
            raise AssertionError(
                f"the trainer did not stop within {STOP_WITHIN_S:.0f} s\n{logs()[-4000:]}"
            ) from None
        took = time.time() - t0
        assert tr.returncode != 0, logs()[-3000:]
        assert not tracebacks(logs()), tracebacks(logs())[:2]
        ck = latest_checkpoint(out)
        assert ck is not None, logs()[-3000:]
        state = load_checkpoint(ck)
        assert state["step"] >= 1 and state["world"] == 2
        steps_done = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert state["step"] == max(steps_done), (state["step"], steps_done)  # every finished step covered
        print(
            f"stop to {who} rank(s): both ranks checkpointed step {state['step']} and exited in {took:.1f} s"
        )

        # the rerun resumes and finishes: every job of the epoch trained exactly once
        _freeze(ex, signal.SIGCONT)
        tr = start(train_args, tmp_path / "train.log")
        deadline = time.time() + 300
        while (tr.poll() is None or ex.poll() is None) and time.time() < deadline:
            time.sleep(0.2)
        assert tr.returncode == 0 and ex.returncode == 0, logs()[-4000:]
    finally:
        for p in (ex, tr):
            if p.poll() is None:
                try:
                    _freeze(p, signal.SIGCONT)
                except psutil.NoSuchProcess:
                    pass
                p.kill()
    assert_exactly_once(mdir, out)
    assert_all_released_and_clean(mdir, store, out)


@pytest.mark.slow  # the default suite's 12 minutes (issue 50); CI runs it (.ci/run)
def test_a_new_run_on_a_manifest_another_run_checkpointed_is_refused(tmp_path):
    """Issue 33 item 6: a trainer killed between a durable checkpoint and the release of what it covers
    (or whose consumes a power loss undid: SQLite commits them without an fsync) leaves the manifest
    showing no trained job; a trainer started with another --out is refused, naming the run to resume,
    and resuming that run repairs the manifest and finishes exactly once."""
    mdir = plan(tmp_path, n=24, extra=EXTRA)
    store, out = tmp_path / "store", tmp_path / "run"
    r = run(["extract", "--manifest", mdir, "--store", store, "--devices", "cpu"])
    assert r.returncode == 0, r.stderr
    r = run(
        ["train", "--manifest", mdir, "--store", store, "--out", out],
        hooked_env(crash_after={"checkpoint": 1}),
    )
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    assert latest_checkpoint(out) is not None
    with Manifest.open(mdir, readonly=True) as m:
        c = m.counts()
        assert c["released"] == c["kept"] == 0 and c["consumed"] > 0  # nothing released: the old rule passed
    r = run(["train", "--manifest", mdir, "--store", store, "--out", tmp_path / "other"])
    assert r.returncode == 1 and not tracebacks(r.stderr), r.stderr
    assert f"is being trained by the run in {out}" in r.stderr and f"--out {out}" in r.stderr, r.stderr
    assert latest_checkpoint(tmp_path / "other") is None
    r = run(["train", "--manifest", mdir, "--store", store, "--out", out])
    assert r.returncode == 0, r.stderr[-3000:]
    assert_exactly_once(mdir, out)
    assert_all_released_and_clean(mdir, store, out)
