"""What ``dflash train`` says about where a run stands (rank 0, on stderr): at the start, whether it
resumes (:func:`resume_line`); at the end, whether it is done (:func:`done_line`: steps, the final
checkpoint, the recent loss and tau estimates, the plot, how to serve it) or stopped cleanly by a
signal or a step or time limit (:func:`stopped_line`: where, and that rerunning the same command
resumes). A clean stop never reads as a crash.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

RECENT = 50  # steps the end-of-run averages are taken over


def resume_line(step: int, checkpoint: Path) -> str:
    return f"train: resuming from step {step} (checkpoint {checkpoint})"


def recent_figures(metrics: Path, n: int = RECENT) -> dict[str, float]:
    """The mean loss and tau estimates over the last ``n`` logged steps of ``metrics.jsonl`` (empty
    where none were logged)."""
    try:
        lines = metrics.read_text().splitlines()[-n:]
    except OSError:
        return {}
    recs = []
    for text in lines:
        try:
            recs.append(json.loads(text))
        except json.JSONDecodeError:
            continue
    out = {}
    for key in ("loss", "tau", "target_tau", "expected_tau"):
        vals = [r[key] for r in recs if isinstance(r.get(key), (int, float))]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


def _figures(metrics: Path) -> str:
    f = recent_figures(metrics)
    names = {"loss": "loss", "tau": "training tau", "target_tau": "tau vs target (greedy)"}
    names["expected_tau"] = "expected tau at T=1"
    parts = [f"{names[k]} {v:.3f}" for k, v in f.items()]
    return f"; over the last {RECENT} steps: " + ", ".join(parts) if parts else ""


def done_line(steps: int, checkpoint: Path | None, out: Path) -> str:
    """The run trained on everything it was given."""
    if checkpoint is None:
        return f"train: done: {steps} steps, no checkpoint (nothing to train on)"
    plot = out / "metrics.png"
    return (
        f"train: done: {steps} steps, final checkpoint {checkpoint}{_figures(out / 'metrics.jsonl')}"
        + (f"; curves in {plot}" if plot.exists() else "")
        + f". Measure it with `dflash eval --drafter {out} ...`; serve it with `dflash serve export "
        f"--drafter {out} ...` (README: Serving the drafter)"
    )


def stopped_line(steps: int, checkpoint: Path | None, why: str, todo: str) -> str:
    """The run stopped cleanly before the end (``why``: "by SIGINT", "at --max-steps 5", ...; ``todo``:
    how to go on)."""
    where = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint yet"
    return f"train: stopped {why} at step {steps}, {where}: {todo}"


def end_line(outcome: tuple, steps: int, checkpoint: Path | None, out: Path) -> str | None:
    """The line for the loop's ``outcome`` (``("done",)`` or ``("stopped", why, todo)``; None: an
    error, which says itself)."""
    if not outcome:
        return None
    if outcome[0] == "done":
        return done_line(steps, checkpoint, out)
    return stopped_line(steps, checkpoint, outcome[1], outcome[2])


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
