"""What ``dflash regenerate`` says while it runs and when it ends, on either path: the progress line
(conversations answered, conversations/s and new tokens/s of this run, ETA) and the closing summary
(answer lengths and stop reasons, and the conversations skipped)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def progress_line(done: int, total: int, now: int, tokens: int, elapsed: float) -> str:
    """``done`` of ``total`` answered, ``now`` of them (with ``tokens`` new tokens) in this run's ``elapsed``
    seconds."""
    rate = now / max(elapsed, 1e-9)
    if done >= total:
        eta = "0s"
    elif now:
        left = int((total - done) / rate)
        eta = f"{left // 3600}h{left // 60 % 60:02d}m" if left >= 3600 else f"{left // 60}m{left % 60:02d}s"
    else:
        eta = "?"
    return (
        f"{done}/{total} conversations | {rate:,.2f} conv/s | {tokens / max(elapsed, 1e-9):,.0f} new tok/s "
        f"| ETA {eta}"
    )


def summarize(recs: list[dict], skipped: dict[int, str] | None = None) -> dict:
    lens = np.asarray([n for r in recs for n in r["new_tokens"]], dtype=np.int64)
    stops = [s for r in recs for s in r["stop"]]
    pct = {f"p{q}": int(np.percentile(lens, q)) for q in (50, 90, 99)} if lens.size else {}
    return {
        "conversations": len(recs),
        "turns": int(lens.size),
        "new_tokens": int(lens.sum()),
        "new_tokens_per_turn": {**pct, "max": int(lens.max()) if lens.size else 0},
        "stops": {k: stops.count(k) for k in ("eos", "length")},
        "skipped": sorted(skipped or {}),
    }


def format_summary(s: dict, out: Path) -> str:
    p = s["new_tokens_per_turn"]
    skipped = s.get("skipped") or []
    return (
        f"regenerate: wrote {out}: {s['conversations']:,} conversations, {s['turns']:,} answers, "
        f"{s['new_tokens']:,} new tokens (per answer: median {p.get('p50', 0)}, p90 {p.get('p90', 0)}, "
        f"max {p['max']}); stopped at eos {s['stops']['eos']:,}, at the length cap {s['stops']['length']:,}"
        + (f"; {len(skipped):,} skipped (lines {_lines(skipped)})" if skipped else "")
    )


def _lines(lines: list[int], n: int = 10) -> str:
    return ", ".join(map(str, lines[:n])) + (f" and {len(lines) - n:,} more" if len(lines) > n else "")


def skipped_line(skipped: dict[int, str], total: int) -> str:
    """The skipped conversations in one phrase: how many, their lines, the first reason."""
    lines = sorted(skipped)
    return (
        f"{len(lines):,} of {total:,} conversations were skipped (lines {_lines(lines)}; "
        f"line {lines[0]}: {skipped[lines[0]]})"
    )
