"""What ``dflash train`` says about where a run stands (rank 0, on stderr): at the start, whether it
resumes (:func:`resume_line`); at the end, whether it is done (:func:`done_line`: steps, the final
checkpoint, the recent loss and tau estimates, the plot, how to serve it) or stopped cleanly by a
signal or a step or time limit (:func:`stopped_line`: where, and that rerunning the same command
resumes). A clean stop never reads as a crash.
"""

from __future__ import annotations

import signal
from pathlib import Path

from dflash_staged.errors import DflashError

RECENT = 50  # logged steps the end-of-run averages are taken over


def resume_line(step: int, checkpoint: Path) -> str:
    return f"train: resuming from step {step} (checkpoint {checkpoint})"


def recent_figures(run_dir: Path, n: int = RECENT) -> tuple[int, dict[str, float]]:
    """``(steps, means)``: the mean loss and tau estimates over the last ``n`` steps of the run's
    ``metrics.jsonl`` that logged a loss (on CUDA only every ``train.log_every``-th does), and how many
    steps that is; ``(0, {})`` when none did."""
    from dflash_staged.train.curves import read_metrics

    try:
        recs = [r for r in read_metrics(run_dir) if isinstance(r.get("loss"), (int, float))][-n:]
    except DflashError:
        return 0, {}
    out = {}
    for key in ("loss", "tau", "target_tau", "expected_tau"):
        vals = [r[key] for r in recs if isinstance(r.get(key), (int, float))]
        if vals:
            out[key] = sum(vals) / len(vals)
    return len(recs), out


def _figures(run_dir: Path) -> str:
    steps, f = recent_figures(run_dir)
    names = {"loss": "loss", "tau": "training tau", "target_tau": "tau vs target (greedy)"}
    names["expected_tau"] = "expected tau at T=1"
    parts = [f"{names[k]} {v:.3f}" for k, v in f.items()]
    return f"; over the last {steps} logged steps: " + ", ".join(parts) if parts else ""


def done_line(steps: int, checkpoint: Path | None, out: Path) -> str:
    """The run trained on everything it was given."""
    if checkpoint is None:
        return f"train: done: {steps} steps, no checkpoint (nothing to train on)"
    plot = out / "metrics.png"
    return (
        f"train: done: {steps} steps, final checkpoint {checkpoint}{_figures(out)}"
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
