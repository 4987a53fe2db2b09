"""Shared helpers of the reliability suite: hooked subprocesses, store scans, end-of-run checks.

Fault injection lives in ``hooks/`` (see ``hooks/dflash_fault_hooks.py``): :func:`hooked_env`
puts that directory on PYTHONPATH with a JSON config, and every Python process started with
that environment (the CLI and the extract workers it spawns) applies the patches.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

from dflash_staged.fsutil import dir_bytes
from dflash_staged.manifest import Manifest
from dflash_staged.train.checkpoint import latest_checkpoint, load_checkpoint

from helpers import env, status

HOOKS_DIR = Path(__file__).resolve().parent / "hooks"
if str(HOOKS_DIR) not in sys.path:
    sys.path.append(str(HOOKS_DIR))  # expected_hidden() of the fake target, for the tests themselves


def hooked_env(**hooks) -> dict:
    """The pipeline test environment plus fault-injection hooks (none if no hooks are given)."""
    e = env()
    if hooks:
        e["PYTHONPATH"] = os.pathsep.join([str(HOOKS_DIR), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        e["DFLASH_TEST_HOOKS"] = json.dumps(hooks)
    return e


def tracebacks(text: str) -> list[str]:
    """The Python tracebacks in a log, but for torchrun's own report that a rank exited with a non-zero
    code (``ChildFailedError``: how torchrun ends when a stop signal made its ranks exit 128 + N). What
    torchrun's agent logs through its logger (each line prefixed ``E1206 12:00:00.000000 PID file:line]``)
    is not a traceback of this project's: with two nodes the agent hosting the store may leave its exit
    barrier before the other agent's wait returns (pytorch/pytorch#69520), after every rank exited 0."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if not lines[i].startswith("Traceback (most recent call last):"):
            i += 1
            continue
        j = i + 1
        while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
            j += 1
        block = "\n".join(lines[i : j + 1])
        if j >= len(lines) or not lines[j].startswith("torch.distributed.elastic.multiprocessing.errors."):
            out.append(block)
        i = j + 1
    return out


# ---------------------------------------------------------------------------------------------- the store
def scan_store(store: Path) -> dict:
    """Published shard directories, temporary/deletion leftovers and bytes on disk (racy but safe)."""
    published, temps, nbytes = [], [], 0
    shards = store / "shards"
    if not shards.is_dir():
        return {"published": published, "temps": temps, "bytes": 0}
    nbytes = dir_bytes(store)
    for edir in shards.glob("e*"):
        try:
            entries = list(edir.iterdir())
        except FileNotFoundError:
            continue
        for p in entries:
            if p.name.startswith("j") and p.name[1:].isdigit():
                published.append((int(edir.name[1:]), int(p.name[1:])))
            elif "~" in p.name:
                temps.append(p.name)
    temps += [p.name for p in store.parent.glob(f".{store.name}.tmp~*")]
    return {"published": published, "temps": temps, "bytes": nbytes}


def chunk_bytes(store) -> int:
    """Bytes of the shards' array data under the store (published, being written, being deleted):
    what the window counts (a shard's few small zarr.json files are left out)."""
    total = 0
    for dirpath, _, files in os.walk(store / "shards"):
        for f in files:
            if f.startswith("c"):
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_size
                except OSError:
                    pass
    return total


# ---------------------------------------------------------------------------------------------- accounting
def assert_exactly_once(mdir: Path, run_dir: Path) -> dict:
    """Every job of every epoch was consumed by exactly one optimizer step (final checkpoint and
    metrics agree); every step is logged exactly once. Returns the final trainer state."""
    with Manifest.open(mdir, readonly=True) as m:
        all_ids = sorted(j.id for j in m.jobs())
    ck = latest_checkpoint(run_dir)
    assert ck is not None, f"no checkpoint in {run_dir}"
    state = load_checkpoint(ck)
    record = state.consumed()
    ids = [c.job for items in record.values() for c in items]
    dup = [i for i, n in Counter(ids).items() if n > 1]
    assert not dup, f"jobs consumed more than once: {dup}"
    assert sorted(ids) == all_ids, f"lost jobs: {sorted(set(all_ids) - set(ids))}"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, state["step"] + 1))
    assert sorted(j for x in lines for j in x["jobs"]) == all_ids
    for x in lines:
        assert x["jobs"] == [c.job for c in record[x["step"]]], x
    assert_fed_as_planned(mdir, lines)
    return state


def assert_fed_as_planned(mdir, lines: list[dict]) -> None:
    """What the model was fed, not only what the ledger says: each step's token digests equal the
    digests of the jobs' samples as planned in the manifest."""
    import numpy as np

    from dflash_staged.train.ledger import token_digest

    with Manifest.open(mdir, readonly=True) as m:
        jobs = {j.id: j for j in m.jobs()}
        for x in lines:
            assert len(x["digests"]) == len(x["jobs"]), x
            for job_id, digest in zip(x["jobs"], x["digests"]):
                planned = np.concatenate([m.sample(s)[0] for s in jobs[job_id].sample_ids])
                assert digest == token_digest(planned), f"step {x['step']}: job {job_id} was fed other tokens"
        assert sum(x["tokens"] for x in lines) == sum(j.real_tokens for j in jobs.values()), "tokens trained"


def assert_all_released_and_clean(mdir: Path, store: Path, run_dir: Path | None = None) -> dict:
    """`dflash status --json` says everything is released; no shard and no leftover remains."""
    st = status(mdir)
    assert st["extract_done"] is True
    assert st["jobs"]["released"] == st["total_jobs"], st["jobs"]
    assert st["window"] == {"shards": 0, "bytes": 0}, st["window"]
    assert st["processes"] == [], st["processes"]
    scan = scan_store(store)
    assert scan["published"] == [], f"unreleased shards on disk: {scan['published'][:10]}"
    assert scan["temps"] == [], f"temporary leftovers in the store: {scan['temps'][:10]}"
    if run_dir is not None:
        left = [p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith("step_")]
        assert left == [], f"checkpoint leftovers: {left}"
        temps = list(run_dir.glob("*.tmp-*")) + list(run_dir.glob(".*.tmp-*"))
        assert not temps, temps
    return st


def side_by_side(tmp_path: Path, mdir, store: Path, out: Path, train_args=(), timeout: float = 400) -> str:
    """``dflash extract`` (one CPU worker) and ``dflash train`` side by side to the end: both exit 0 and
    print no traceback; their logs (tmp_path/extract.log, train.log) are returned."""
    from helpers import start

    ex = start(
        ["extract", "--manifest", mdir, "--store", store, "--devices", "cpu"], tmp_path / "extract.log"
    )
    tr = start(
        ["train", "--manifest", mdir, "--store", store, "--out", out, *train_args], tmp_path / "train.log"
    )
    deadline = time.time() + timeout
    while (ex.poll() is None or tr.poll() is None) and time.time() < deadline:
        time.sleep(0.2)
    for p in (ex, tr):
        if p.poll() is None:
            p.kill()
    logs = (tmp_path / "extract.log").read_text() + (tmp_path / "train.log").read_text()
    assert ex.returncode == 0 and tr.returncode == 0, logs[-4000:]
    assert not tracebacks(logs), tracebacks(logs)[:2]
    return logs
