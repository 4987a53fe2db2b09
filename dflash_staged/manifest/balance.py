"""Both sides' busy and idle time, which side is the bottleneck, and the split of devices that balances them.

This docstring is the contract; extract, train, ``dflash status`` and the launchers follow it.

**The figures.** Each side counts device-seconds by kind (:data:`SIDES`) since its loop began:

* an extract worker (:mod:`dflash_staged.extract.worker`; a tensor-parallel group counts each second
  once per device): ``busy_s`` from a claim that got a job to the next claim (the batch, the forward,
  handing the shard to the writer, which may wait for the previous shard), ``window_full_s`` while
  claims are refused because the window is full (waiting for the trainer to release shards), and
  ``no_work_s`` while nothing is left to claim otherwise (every job claimed or extracted: the end of
  extraction, or staying for re-extractions). Loading the target does not count.
* a trainer rank (:mod:`dflash_staged.train.loop`): ``data_wait_s``, the sum of the steps'
  ``data_wait_s`` in ``metrics.jsonl`` (waiting until every rank's buffer is ready, reading shards),
  and ``busy_s``, the rest of its time (forward, backward, optimizer, checkpoints). Counting starts
  when its first step's data has arrived: the wait for the first shards is start-up.

Each stretch of time is credited when it ends (an extract worker's at its next claim, a trainer's when
a step's data has arrived), so a long forward or wait shows late. An extract worker sends its seconds
to its supervisor (``dflash extract``), which sums its workers; the supervisor and each trainer rank
publish a :class:`Tally` snapshot with their registration every :data:`PUBLISH_S`
(``Manifest.report``: the registration's ``info["balance"]``), and when they end, once more as the
event ``balance:<role>``, so that the figures outlive the process::

    {"t": unix time, "devices": ["cuda:0", ...], "tp": N, "host": ..., "run": ..., "rank": ...,
     "total": {kind: seconds}, "recent": {kind: seconds over the last recent_s}, "recent_s": seconds}

``recent`` covers the last :data:`RECENT_S` seconds or a little more (for a finished process, its
last ones). :func:`collect` sums each side over its live processes, or, when none is live, over the
final figures of its last run (a trainer: the ranks of its last run; extract: the last run of each
host), into what ``dflash status --json`` shows as ``balance``; :func:`format_balance` and
:func:`short` are its human forms (a live side's figures older than :data:`STALE_S` say so).

**The verdict** (:func:`verdict`), over one interval, from each side's shares of its time: a side
*waits* when its idle share (extract: on a full window; train: for data) is at least
:data:`WAITS`.

* only extract waits, or both and extract more: **training is the bottleneck**;
* only train waits, or both and train more: **extraction is the bottleneck** (when extract also
  found nothing to claim for :data:`WAITS` of its time, the text says the split may not be the
  cause: jobs held by claims elsewhere, failing, or being re-extracted; or the end of a short run);
* neither waits, but extract found nothing to claim for :data:`WAITS` of its time (it ran ahead of
  a trainer that never waited, e.g. a plan smaller than the window): **training is the bottleneck**;
* otherwise: **balanced**.

A verdict against training with no trainer running and jobs left to train (the trainer was stopped or
died, and extract waits for one) names no split: extract's waits then say nothing of the trainer's
speed, so the text says to start ``dflash train`` instead.

With both waiting at least :data:`WAITS`, the text also says that the window is too small for the
pipeline's jitter (``--window``, or ``train.checkpoint_every``: consumed shards leave the window only
at a checkpoint).

**The split**: the verdict estimates the per-device rates from the busy device-seconds ``B_e``, ``B_t``
of one interval, in which both sides moved about the same tokens (``r_e : r_t = 1/B_e : 1/B_t``), asks
:func:`dflash_staged.split.choose_split` (the same chooser as ``dflash node --split auto``) for the best
split of the devices running now, and names it when it differs from the one running by at least
:data:`MIN_GAIN`, with the gain ``best / min(e r_e, (N - e) r_t)`` at the current split.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from dflash_staged.split import choose_split

SIDES = {"extract": ("busy_s", "window_full_s", "no_work_s"), "train": ("busy_s", "data_wait_s")}
IDLE_KIND = {"extract": "window_full_s", "train": "data_wait_s"}  # the idle that names a bottleneck
RECENT_S = 60.0  # the recent interval
PUBLISH_S = 2.0  # how often a process publishes its figures
WAITS = 0.05  # an idle share from which a side counts as waiting
MIN_GAIN = 0.05  # a split is suggested when it promises at least this much more throughput
STALE_S = 30.0  # a live side's figures older than this are shown with their age


class Tally:
    """Cumulative seconds per kind and, at each :meth:`snapshot`, the same over the last ``recent_s``
    (time is the caller's: pass a monotonic clock's ``now``)."""

    def __init__(self, kinds: Iterable[str], now: float, recent_s: float = RECENT_S):
        self.kinds, self.recent_s = tuple(kinds), recent_s
        self.total = dict.fromkeys(self.kinds, 0.0)
        self._marks: deque[tuple[float, dict[str, float]]] = deque([(now, dict(self.total))])

    def add(self, kind: str, seconds: float) -> None:
        self.total[kind] += max(0.0, seconds)

    def set(self, totals: Mapping[str, float]) -> None:
        """Replace the totals (a sum kept elsewhere, e.g. over workers); they never go back."""
        self.total = {k: max(self.total[k], float(totals.get(k, 0.0))) for k in self.kinds}

    def snapshot(self, now: float) -> dict[str, Any]:
        """``{"total", "recent", "recent_s"}``; ``recent`` since the newest mark at least ``recent_s`` old."""
        self._marks.append((now, dict(self.total)))
        while len(self._marks) > 1 and self._marks[1][0] <= now - self.recent_s:
            self._marks.popleft()
        t0, base = self._marks[0]
        return {
            "total": {k: round(v, 3) for k, v in self.total.items()},
            "recent": {k: round(self.total[k] - base[k], 3) for k in self.kinds},
            "recent_s": round(now - t0, 3),
        }


def shares(seconds: Mapping[str, float]) -> dict[str, float]:
    """Each kind's share of the sum (zeros when the sum is zero)."""
    total = sum(seconds.values())
    return {k: (v / total if total > 0 else 0.0) for k, v in seconds.items()}


def verdict(
    extract: Mapping[str, float] | None,
    train: Mapping[str, float] | None,
    n_extract: int = 0,
    n_train: int = 0,
    tp: int = 1,
    unit: str = "GPUs",
) -> dict[str, Any]:
    """The bottleneck over one interval (module docstring) from each side's seconds per kind (device-
    seconds, :data:`SIDES`; None when that side has no figures): ``{"bottleneck": "train" | "extract" |
    "none" | None, "text": str, "split": [e, t] | None, "gain": float | None}``. ``n_extract``,
    ``n_train``: the devices running now (0: unknown, no split is suggested)."""
    missing = [side for side, s in (("extract", extract), ("train", train)) if not s or sum(s.values()) <= 0]
    if missing:
        return {
            "bottleneck": None,
            "text": f"no figures from {' or '.join(missing)} yet",
            "split": None,
            "gain": None,
        }
    e, t = shares(extract), shares(train)
    ef, en, tw = e["window_full_s"], e["no_work_s"], t["data_wait_s"]
    said = f"extract idle {ef:.0%} on a full window, train waiting {tw:.0%} for data"
    out: dict[str, Any] = {"bottleneck": "none", "text": f"balanced: {said}", "split": None, "gain": None}
    if ef >= WAITS and ef >= tw:
        out["bottleneck"] = "train"
        out["text"] = f"extract idle {ef:.0%} on a full window: training is the bottleneck"
    elif tw >= WAITS:
        out["bottleneck"] = "extract"
        out["text"] = f"train waiting {tw:.0%} for data: extraction is the bottleneck"
        if en >= WAITS:
            out["text"] += (
                f" (extract also found nothing to claim {en:.0%} of the time: when jobs are held by "
                "claims elsewhere, failing or being re-extracted, the split is not the cause; dflash "
                "status --jobs)"
            )
    elif en >= WAITS:
        out["bottleneck"] = "train"
        out["text"] = (
            f"extract idle {en:.0%} with nothing left to claim (it ran ahead) while train waited only "
            f"{tw:.0%}: training is the bottleneck"
        )
    else:
        return out
    if ef >= WAITS and tw >= WAITS:
        out["text"] += (
            f" (the other side waits too, {min(ef, tw):.0%}: raise --window, or lower "
            "train.checkpoint_every so consumed shards leave the window sooner)"
        )
    out.update(_suggest(out["bottleneck"], extract["busy_s"], train["busy_s"], n_extract, n_train, tp, unit))
    out["text"] += "; " + out.pop("advice")
    return out


def _suggest(side: str, busy_e: float, busy_t: float, n_e: int, n_t: int, tp: int, unit: str) -> dict:
    frm, to = ("extract", "train") if side == "train" else ("train", "extract")
    if n_e <= 0 or n_t <= 0 or busy_e <= 0 or busy_t <= 0:
        return {"advice": f"move {unit} from {frm} to {to}"}
    rate_e, rate_t = 1.0 / busy_e, 1.0 / busy_t
    best = choose_split(n_e + n_t, tp, rate_e * tp, rate_t)  # a worker of tp devices writes tp x r_e
    e, t, rate = best.extract_devices, best.train_ranks, best.throughput
    gain = rate / min(n_e * rate_e, n_t * rate_t)
    if e == n_e or gain < 1 + MIN_GAIN:
        return {
            "advice": f"no other split of the {n_e + n_t} {unit} does better by {MIN_GAIN:.0%} ({n_e} "
            f"extract + {n_t} train is as good as any): add {unit} to {to}",
            "split": [n_e, n_t],
            "gain": 1.0,
        }
    return {
        "advice": f"move {unit} from {frm} to {to} (e.g. {e} extract + {t} train, about {gain:.2f}x "
        "the throughput)",
        "split": [e, t],
        "gain": round(gain, 3),
    }


def _last_run(figures: list[dict], one_run: bool) -> list[dict]:
    """The final figures to show for a side with no live process: the last of each (run, rank);
    with ``one_run``, only those of the newest run."""
    last: dict[tuple, dict] = {}
    for f in figures:  # oldest first
        key = (f.get("run"), f.get("rank"))
        last.pop(key, None)
        last[key] = f
    if one_run and last:
        newest = list(last.values())[-1].get("run")
        return [f for f in last.values() if f.get("run") == newest]
    return list(last.values())


def _combine(figures: list[dict], kinds: tuple[str, ...], live: bool, now: float) -> dict[str, Any]:
    devices = [d for f in figures for d in f.get("devices", [])]
    return {
        "live": live,
        "processes": len(figures),
        "devices": devices,
        "tp": max((int(f.get("tp") or 1) for f in figures), default=1),
        "age_s": round(max(0.0, now - max(float(f.get("t") or 0) for f in figures)), 1),
        "recent_s": max(float(f.get("recent_s") or 0) for f in figures),
        "total": {k: round(sum(float(f.get("total", {}).get(k, 0)) for f in figures), 3) for k in kinds},
        "recent": {k: round(sum(float(f.get("recent", {}).get(k, 0)) for f in figures), 3) for k in kinds},
    }


def collect(
    procs: Iterable[Any], finished: Mapping[str, list[dict]], now: float, train_left: int = 0
) -> dict[str, Any]:
    """``status()["balance"]``: per side (``extract``, ``train``) its summed figures or None, and the
    verdict over each interval (``verdict``: ``{"recent": ..., "total": ...}``). ``procs``: the live
    registrations (:class:`~dflash_staged.manifest.states.Proc`); ``finished``: per role, the final
    figures of the ``balance:<role>`` events, oldest first; ``now``: unix time; ``train_left``: the
    jobs not trained yet (with no live trainer, a verdict against training advises no split)."""
    out: dict[str, Any] = {}
    for role, kinds in SIDES.items():
        live = [
            p.info["balance"] for p in procs if p.role == role and isinstance(p.info.get("balance"), dict)
        ]
        figures = live or _last_run(list(finished.get(role, [])), one_run=role == "train")
        out[role] = _combine(figures, kinds, bool(live), now) if figures else None
    ex, tr = out["extract"], out["train"]
    n_e, n_t = (len(ex["devices"]) if ex else 0), (len(tr["devices"]) if tr else 0)
    devices = (ex["devices"] if ex else []) + (tr["devices"] if tr else [])
    unit = "GPUs" if devices and all(str(d).startswith("cuda") for d in devices) else "devices"
    out["verdict"] = {
        span: verdict(
            ex[span] if ex else None, tr[span] if tr else None, n_e, n_t, ex["tp"] if ex else 1, unit
        )
        for span in ("recent", "total")
    }
    if tr and not tr["live"] and train_left > 0:
        for span, v in out["verdict"].items():
            if v["bottleneck"] == "train":
                out["verdict"][span] = _trainer_gone(train_left)
    return out


def _trainer_gone(train_left: int) -> dict[str, Any]:
    return {
        "bottleneck": None,
        "text": f"no trainer is running and {train_left} job(s) are left to train: extract waits for one, "
        "which says nothing of the split; start `dflash train` (the same command resumes) to go on",
        "split": None,
        "gain": None,
    }


def by_node(
    procs: Iterable[Any], finished: Mapping[str, list[dict]], now: float
) -> dict[str, dict[str, Any]]:
    """Node-local stores (:mod:`.layout`): :func:`collect` over each host's processes and final figures
    alone, keyed by host name."""
    procs = list(procs)
    hosts = {p.host for p in procs} | {f.get("host") for fs in finished.values() for f in fs}
    return {
        h: collect(
            [p for p in procs if p.host == h],
            {r: [f for f in fs if f.get("host") == h] for r, fs in finished.items()},
            now,
        )
        for h in sorted(x for x in hosts if x)
    }


def node_imbalance(nodes: Mapping[str, Mapping[str, Any]], span: str = "recent") -> str | None:
    """A node whose ranks wait for data (at least :data:`WAITS` of their time) while another node's
    extract waits on its full window and its ranks wait at least :data:`WAITS` less: named, with what
    to change; None when no such pair."""

    def share(b, role: str, kind: str) -> float:
        s = b.get(role)
        return shares(s[span]).get(kind, 0.0) if s and sum(s[span].values()) > 0 else 0.0

    wait = {h: share(b, "train", "data_wait_s") for h, b in nodes.items()}
    full = {h for h, b in nodes.items() if share(b, "extract", "window_full_s") >= WAITS}
    # starved: ranks that wait, beside a node whose window is full and whose ranks wait less (by WAITS)
    starved = sorted(
        h for h in nodes if wait[h] >= WAITS and any(wait[f] + WAITS <= wait[h] for f in full - {h})
    )
    if not starved:
        return None
    full = sorted(f for f in full if f not in starved)
    s, f = ", ".join(starved), ", ".join(full)
    return (
        f"node(s) {s}: trainer ranks wait for data while the window of {f} is full; with node-local "
        f"stores a node trains only on its own shards: give {s} more extract GPUs (dflash node --split), "
        f"or {f} more trainer ranks, so that every node is balanced"
    )


_NAMES = {
    "busy_s": "busy",
    "window_full_s": "window full",
    "no_work_s": "nothing to claim",
    "data_wait_s": "data wait",
}


def _side(b: Mapping[str, Any], role: str, span: str) -> str:
    s = b.get(role)
    if not s:
        return f"{role}: no figures"
    sh = shares(s[span])
    parts = ", ".join(f"{_NAMES[k]} {v:.0%}" for k, v in sh.items())
    where = f"{len(s['devices'])} device(s)" + ("" if s["live"] else ", finished")
    where += f", figures {s['age_s']:.0f} s old" if s["live"] and s["age_s"] > STALE_S else ""
    return f"{role} {parts} ({where})"


def format_balance(b: Mapping[str, Any] | None) -> list[str]:
    """The human lines of ``status()["balance"]``: each side's shares over the recent interval and the
    whole run, and the verdict over each."""
    if not b or not (b.get("extract") or b.get("train")):
        return []
    recent = max((b[r]["recent_s"] for r in SIDES if b.get(r)), default=0.0)
    lines = []
    for span, label in (("recent", f"last {recent:.0f} s"), ("total", "whole run")):
        lines.append(f"time ({label}): " + "; ".join(_side(b, r, span) for r in SIDES))
    for span, label in (("recent", f"last {recent:.0f} s"), ("total", "whole run")):
        lines.append(f"bottleneck ({label}): {b['verdict'][span]['text']}")
    return lines


def short(b: Mapping[str, Any] | None, span: str = "recent") -> str:
    """One status-line fragment: both sides' idle shares over ``span`` (extract's on a full window and
    with nothing to claim, and the first of them) and the bottleneck's name."""
    if not b:
        return ""
    parts = []
    for role, label in (("extract", "extract idle"), ("train", "train waits")):
        s = b.get(role)
        if s and sum(s[span].values()) > 0:
            sh = shares(s[span])
            idle = sh[IDLE_KIND[role]] + sh.get("no_work_s", 0.0)
            full = f" (window full {sh['window_full_s']:.0%})" if role == "extract" else ""
            parts.append(f"{label} {idle:.0%}{full}")
    name = {
        "train": "training is the bottleneck",
        "extract": "extraction is the bottleneck",
        "none": "balanced",
    }
    v = b.get("verdict", {}).get(span, {})
    tail = name.get(v.get("bottleneck"), "")
    return ", ".join(parts) + (f": {tail}" if tail and parts else "")
