"""Training curves: loss, training tau and the learning rate against steps, from ``metrics.jsonl``;
with the target's last layer in the store also tau against the target (greedy, and expected under
sampling at T = 1, from the overlap ``sum min(p, q)``) on the steps that logged them.

``dflash plot RUN_DIR`` draws ``RUN_DIR/metrics.png`` (``--out`` elsewhere); ``dflash train``
draws it at the end of a run when matplotlib is installed (the ``dev``/``demo`` extras).
Steps whose loss was not synchronised (CUDA, between ``train.log_every``) are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_staged.errors import DflashError
from dflash_staged.fsutil import write_figure_atomic


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    try:
        text = path.read_text()
    except OSError as e:
        raise DflashError(
            f"{path}: cannot read the run's metrics ({e.strerror}); give a run directory of "
            "`dflash train --out`"
        ) from None
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def plot_metrics(run_dir: Path, out: Path | None = None) -> Path:
    """Draw the curves of ``run_dir`` into a PNG (atomically); returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DflashError(
            "plotting needs matplotlib: pip install matplotlib (or the dev/demo extra)"
        ) from None
    recs = [r for r in read_metrics(run_dir) if r.get("loss") is not None]
    if not recs:
        raise DflashError(f"{run_dir}/metrics.jsonl has no step with a loss yet; train first")
    steps = [r["step"] for r in recs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(
        axes, ("loss", "tau", "lr"), ("loss", "training tau (implied)", "learning rate")
    ):
        ax.plot(steps, [r.get(key) for r in recs], lw=1)
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    if len(recs) > 20:  # a running mean over about 5% of the steps shows the trend through the noise
        k = max(2, len(recs) // 20)
        for ax, key in zip(axes[:2], ("loss", "tau")):
            v = [r[key] for r in recs]
            ax.plot(steps[k - 1 :], [sum(v[i - k + 1 : i + 1]) / k for i in range(k - 1, len(v))], lw=2)
    target = [r for r in recs if r.get("expected_tau") is not None]  # the store holds the target's last layer
    if target:  # tau against the target itself: greedy (its argmax) and expected under sampling (T = 1)
        ts = [r["step"] for r in target]
        for key, label in (("target_tau", "greedy vs target"), ("expected_tau", "expected at T=1")):
            axes[1].plot(ts, [r[key] for r in target], lw=1, marker=".", ms=3, label=label)
        axes[1].legend(fontsize=7)
    fig.suptitle(
        f"{Path(run_dir).resolve().name}: {steps[-1]} steps, {sum(r['tokens'] for r in recs):,} tokens",
        fontsize=9,
    )
    fig.tight_layout()
    return write_figure_atomic(Path(out) if out else Path(run_dir) / "metrics.png", fig)
