"""The launcher's view of a run: a combined status line while it runs, and a summary at the end.

Both read the manifest (read-only) and the store's size on disk; nothing here changes anything. Both
show the two sides' idle shares and the bottleneck (:mod:`dflash_staged.manifest.balance`): the
status line over the last minute, the summary over each side's last minute and its whole run.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from dflash_staged.fsutil import dir_bytes, write_json_atomic
from dflash_staged.manifest import Manifest, group_counts
from dflash_staged.manifest.balance import format_balance, short
from dflash_staged.manifest.status import human_bytes as human


class Monitor:
    """Read-only view of the manifest and the store size, for the status line and the summary."""

    def __init__(self, manifest: Path | str | None, store: Path | None, run_dir: Path | None):
        self.manifest, self.store, self.run_dir = manifest, store, run_dir
        self.m = None
        self.peak_store = self.last_store = 0
        self.peak_window = {"shards": 0, "bytes": 0}
        self._next_sample, self._walk_s = 0.0, 0.0

    def _open(self):
        if self.m is None and self.manifest is not None and Manifest.exists(self.manifest):
            self.m = Manifest.open(self.manifest, readonly=True)
        return self.m

    def sample_store(self) -> int:
        """Store bytes now (walk at most every max(1 s, 20 x the walk time)); tracks the peak."""
        if self.store is None or time.monotonic() < self._next_sample:
            return self.last_store
        t = time.monotonic()
        now = dir_bytes(self.store)
        self._walk_s = time.monotonic() - t
        self._next_sample = time.monotonic() + max(1.0, 20 * self._walk_s)
        self.peak_store = max(self.peak_store, now)
        self.last_store = now
        return now

    def status(self) -> dict | None:
        try:
            m = self._open()
            if m is None:
                return None
            st = m.status()
        except Exception:  # noqa: BLE001 - a status line is best effort (db busy, being created, ...)
            return None
        w = st["window"]
        if w["shards"] > self.peak_window["shards"] or w["bytes"] > self.peak_window["bytes"]:
            self.peak_window = {
                "shards": max(w["shards"], self.peak_window["shards"]),
                "bytes": max(w["bytes"], self.peak_window["bytes"]),
            }
        return st

    def line(self) -> str | None:
        st = self.status()
        store_now = self.sample_store()
        if st is None:
            return None
        j, total = st["jobs"], max(1, st["total_jobs"])
        extracted, trained = st["groups"]["extracted"], st["groups"]["trained"]
        w = st["window"]
        idle = short(st.get("balance"))
        return (
            f"jobs extracted {extracted}/{total}, trained {trained}/{total}"
            f"{', failed ' + str(j['failed']) if j['failed'] else ''} | window {w['shards']} shards "
            f"{human(w['bytes'])} | store {human(store_now)} "
            f"(peak {human(self.peak_store)})" + (f" | {idle}" if idle else "")
        )

    def losses(self) -> tuple[int, float | None, float | None]:
        steps, first, last = 0, None, None
        path = self.run_dir / "metrics.jsonl" if self.run_dir else None
        if path is None or not path.is_file():
            return steps, first, last
        for text in path.read_text().splitlines():
            try:
                rec = json.loads(text)
            except ValueError:
                continue
            steps = max(steps, int(rec.get("step") or 0))
            if rec.get("loss") is not None:
                first = rec["loss"] if first is None else first
                last = rec["loss"]
        return steps, first, last

    def close(self) -> None:
        if self.m is not None:
            self.m.close()


def ended(child) -> str:
    """How a child ended, for the summary: a child its supervisor stopped and that exited on that
    signal stopped cleanly (train checkpointed); anything else is its exit code."""
    code = child.exit_code()
    clean = (0, 128 + signal.SIGINT, 128 + signal.SIGTERM)  # (exit_code() gives a signal's death as 128 + N)
    if getattr(child, "stopped", False) and code in clean:
        return "stopped cleanly"
    return f"exit {code}"


def summary(
    say,
    mon: Monitor,
    code: int,
    plan_s: float,
    ex,
    tr,
    total_s: float,
    summary_path: Path | None,
    balance: bool = True,
    stopped: bool = False,
) -> dict:
    """The launcher's closing lines (and ``summary_path``'s JSON); ``balance``: with both sides' time
    lines (False when extract has printed them already); ``stopped``: the launcher was stopped by a
    signal (a clean stop: said so, never read as a crash)."""
    mon._next_sample = 0.0
    mon.sample_store()
    st = mon.status() or {}
    tok = group_counts(st.get("tokens_by_state", {}))
    steps, first, last = mon.losses()
    s = {
        "exit_code": code,
        "plan_s": round(plan_s, 2),
        "extract_s": round(ex.seconds(), 2),
        "train_s": round(tr.seconds(), 2),
        "total_s": round(total_s, 2),
        "extract_exit": ex.exit_code(),
        "train_exit": tr.exit_code(),
        "jobs": st.get("jobs"),
        "total_jobs": st.get("total_jobs"),
        "tokens_extracted": tok["extracted"],
        "tokens_trained": tok["trained"],
        "peak_store_bytes": mon.peak_store,
        "peak_window": mon.peak_window,
        "steps": steps,
        "loss_first": first,
        "loss_last": last,
        "manifest": mon.m.address if mon.m else (str(mon.manifest) if mon.manifest else None),
        "store": str(mon.store) if mon.store else None,
        "run_dir": str(mon.run_dir) if mon.run_dir else None,
        "balance": st.get("balance"),
    }
    clean = stopped and ended(ex) == ended(tr) == "stopped cleanly"  # a crash while stopping stays one
    head = f"stopped cleanly (exit {code}); rerun the same command to resume" if clean else f"exit {code}"
    say(
        f"summary: {head} | plan {plan_s:.1f} s, extract {ex.seconds():.1f} s ({ended(ex)}), "
        f"train {tr.seconds():.1f} s ({ended(tr)}), total {total_s:.1f} s"
    )
    if st:
        jobs = ", ".join(f"{k} {n}" for k, n in st["jobs"].items() if n)
        say(
            f"jobs {st['total_jobs']}: {jobs} | tokens extracted {s['tokens_extracted']:,}, trained "
            f"{s['tokens_trained']:,} | peak store {human(mon.peak_store)} ({mon.peak_store:,} B), peak "
            f"window {mon.peak_window['shards']} shards"
        )
    for line in format_balance(st.get("balance")) if balance else []:
        say(line)
    if steps:
        say(
            f"training: {steps} steps, loss {first if first is None else f'{first:.4f}'} -> "
            f"{last if last is None else f'{last:.4f}'} | run dir {mon.run_dir}"
        )
    if summary_path is not None:
        write_json_atomic(summary_path, s)
    return s
